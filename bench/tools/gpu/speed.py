"""The speed table: the adapters' copies against a pinned-memory memcpy of the same
bytes (GPU time, wall clock of one call, host time per call, a step of 8 chunks)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from lmcache_connector.layouts.kv_adapters import BlockLayout, TokenLayout
from lmcache_connector.transfers.layerwise import LoadItem, SaveItem

from .common import BAR, RESULTS, TABLE, _Held, _llama, _time_cuda, _wall, log, section


@section("speed", gpu_only="")
def speed(quick: bool) -> None:
    iters = 5 if quick else 15
    out: dict[str, Any] = {}
    # The link's limit: a large pinned copy each way.
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    hbig = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    lim_d2h = (256 << 20) / _wall(lambda: hbig.copy_(big, non_blocking=True), 5, True) / 1e9
    lim_h2d = (256 << 20) / _wall(lambda: big.copy_(hbig, non_blocking=True), 5, True) / 1e9
    out["link_GBps"] = {"d2h": round(lim_d2h, 1), "h2d": round(lim_h2d, 1)}
    log(f"  link (256 MiB pinned memcpy): D2H {lim_d2h:.1f} GB/s, H2D {lim_h2d:.1f} GB/s")
    worst = 9.0
    rows = []

    def events(fn: Callable[[], object]) -> float:
        return _time_cuda(fn, iters)

    def add(mib: float, kind: str, what: str, secs: float, base: float, timing: str) -> None:
        nonlocal worst
        ratio = base / secs
        if timing == "gpu":
            worst = min(worst, ratio)
        nbytes = mib * 2**20
        rows.append(
            {
                "MiB": mib,
                "adapter": kind,
                "op": what,
                "timing": timing,
                "GBps": round(nbytes / secs / 1e9, 2),
                "memcpy_GBps": round(nbytes / base / 1e9, 2),
                "ratio": round(ratio, 3),
            }
        )
        log(
            f"  {mib:5.1f} MiB {kind:5} {what:22} [{timing:5}] {nbytes / secs / 1e9:6.2f} GB/s (memcpy {nbytes / base / 1e9:6.2f}) = {ratio:.2f}x"
        )

    for tokens in (16, 64, 256):  # 2, 8, 32 MiB at 128 KiB per token
        kv = _llama(8 * tokens, "cuda", seed=tokens)
        nb = next(iter(kv.values())).shape[0]
        perm = torch.randperm(nb).tolist()
        table = perm[: -(-tokens // 16)]
        for kind in ("token", "block"):
            lay = TokenLayout(kv, 16) if kind == "token" else BlockLayout(kv, 16)
            host = torch.empty(lay.chunk_shape(tokens), dtype=lay.dtype, pin_memory=True)
            dev = torch.empty_like(host, device="cuda")
            nbytes = host.numel() * host.element_size()
            mib = round(nbytes / 2**20, 1)
            # GPU time (CUDA events): the copy engine and the kernels, no host overhead
            d2h = events(lambda: host.copy_(dev, non_blocking=True))
            h2d = events(lambda: dev.copy_(host, non_blocking=True))
            add(mib, kind, "gather->pinned", events(lambda: lay.save_chunk(table, 0, tokens, host, wait=False)), d2h, "gpu")
            add(mib, kind, "scatter<-pinned", events(lambda: lay.load_chunk(host, table, 0, tokens, 0, wait=False)), h2d, "gpu")
            # wall clock of one call as the worker makes it (host overhead + wait)
            wd2h = _wall(lambda: host.copy_(dev, non_blocking=True), iters, True)
            wh2d = _wall(lambda: dev.copy_(host, non_blocking=True), iters, True)
            add(mib, kind, "gather->pinned", _wall(lambda: lay.save_chunk(table, 0, tokens, host), iters, False), wd2h, "wall")
            add(
                mib, kind, "scatter<-pinned", _wall(lambda: lay.load_chunk(host, table, 0, tokens, 0), iters, False), wh2d, "wall"
            )

            # host time per call (calls back to back, waited for at the end)
            def host_us(fn: Callable[[], object], n: int = 30) -> float:
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                spent = (time.perf_counter() - t0) / n * 1e6
                torch.cuda.synchronize()
                return round(spent, 1)

            index = (lambda: lay.slot_mapping(table, 0, tokens)) if kind == "token" else (lambda: lay._index(table))
            hu = {
                "index": host_us(index),
                "save_enqueue": host_us(lambda: lay.save_chunk(table, 0, tokens, host, wait=False)),
                "load_enqueue": host_us(lambda: lay.load_chunk(host, table, 0, tokens, 0, wait=False)),
                "memcpy_enqueue": host_us(lambda: host.copy_(dev, non_blocking=True)),
            }
            out.setdefault("host_us_per_call", {})[f"{mib:g}MiB/{kind}"] = hu
            log(f"  {mib:5.1f} MiB {kind:5} host us per call: {hu}")
            if mib == 2.0:
                TABLE.append((f"host us per call, 2 MiB {kind}", ", ".join(f"{k} {v}" for k, v in hu.items()), "info"))
            # a step of 8 such chunks, enqueued together and waited for once (the worker on a GPU)
            hosts = [torch.empty_like(host).pin_memory() for _ in range(8)]
            tables = [perm[c * len(table) : (c + 1) * len(table)] for c in range(8)]

            def memcpy8(d2h_dir: bool) -> None:
                for h in hosts:
                    (h.copy_(dev, non_blocking=True) if d2h_dir else dev.copy_(h, non_blocking=True))

            # as the worker copies a transfer on a GPU: layout.copy_many (one kernel
            # call, a 2-D DMA per chunk), waited for once
            saves8 = [SaveItem(_Held(h), tb, 0, tokens) for h, tb in zip(hosts, tables)]
            loads8 = [LoadItem(_Held(h), tb, 0, tokens, 0) for h, tb in zip(hosts, tables)]

            def save8() -> None:
                lay.copy_many(saves8, False)
                lay.finish()

            def load8() -> None:
                lay.copy_many(loads8, True)
                lay.finish()

            add(8 * mib, kind, "8 chunks gather", _wall(save8, iters, False), _wall(lambda: memcpy8(True), iters, True), "wall")
            add(8 * mib, kind, "8 chunks scatter", _wall(load8, iters, False), _wall(lambda: memcpy8(False), iters, True), "wall")
    out["rows"] = rows
    out["worst_ratio"] = round(worst, 3)
    RESULTS["speed"] = out
    for timing, label in (("gpu", "GPU time"), ("wall", "wall, one call")):
        for mib in (2.0, 8.0, 32.0):
            sel = [r for r in rows if r["timing"] == timing and r["MiB"] == mib]
            if sel:
                figs = ", ".join(f"{r['adapter']} {r['op'].split('-')[0].split('<')[0]} {r['ratio']:.2f}" for r in sel)
                TABLE.append((f"speed {mib:g} MiB {label}", figs, "PASS" if min(r["ratio"] for r in sel) >= BAR else "MISS"))
    sel = [r for r in rows if r["op"].startswith("8 chunks")]
    for mib in sorted({r["MiB"] for r in sel}):
        figs = ", ".join(f"{r['adapter']} {r['op'].split()[-1]} {r['ratio']:.2f}" for r in sel if r["MiB"] == mib)
        TABLE.append(
            (
                f"speed step of 8 x {mib / 8:g} MiB, wall",
                figs,
                "PASS" if min(r["ratio"] for r in sel if r["MiB"] == mib) >= BAR else "MISS",
            )
        )
    best = max(r["GBps"] for r in rows)
    TABLE.append(("link limit D2H/H2D GB/s", f"{lim_d2h:.1f}/{lim_h2d:.1f} (best adapter {best:.1f})", "info"))
