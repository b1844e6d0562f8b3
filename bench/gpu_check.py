"""One prepared run on a CUDA GPU: build lmcache_cuda, run tests/cuda, check the
connector's layout adapters and the engine below vLLM, measure the copies against a
pinned-memory memcpy of the same bytes, measure layer-by-layer overlap; a short
table last.

    python bench/gpu_check.py [--out DIR] [--quick]      # or: bash bench/gpu_check.sh

Needs torch with CUDA and nvcc (for the kernels; without them the torch path is
measured and the table says so). vLLM is not needed: the adapters, the layer pipeline
and the engine are driven directly, with vLLM 0.32's real per-layer KV layouts built
as plain CUDA tensors (lmcache_cuda.testing.vllm_kv_caches). Without a GPU it runs
what it can on the CPU (a dry run) and says so. Never part of the test pass.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("", "connector", "cuda"):
    p = str(ROOT / sub)
    if p not in sys.path:
        sys.path.insert(0, p)

import lmcache_cuda  # noqa: E402
from lmcache_connector.layouts.kv_adapters import BlockLayout, TokenLayout  # noqa: E402
from lmcache_connector.transfers.layerwise import LayerPipeline, LoadItem, SaveItem  # noqa: E402
from lmcache_cuda.paged_layout import int_view  # noqa: E402
from lmcache_cuda.testing import poison_like, vllm_kv_caches  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from lib.timing import time_cuda as _time_cuda  # noqa: E402  (CUDA-event timing, shared)

BAR = 0.8
HIDE_GOAL = 0.8
RESULTS: dict[str, Any] = {"sections": {}}
TABLE: list[tuple[str, str, str]] = []  # (check, figure, verdict)


def log(*a: Any) -> None:
    print(*a, flush=True)


def section(name: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def run(*args: Any, **kw: Any) -> Any:
            log(f"\n=== {name} ===")
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kw)
                RESULTS["sections"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1)}
                return out
            except Exception as err:
                traceback.print_exc()
                RESULTS["sections"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                TABLE.append((name, f"ERROR {type(err).__name__}", "FAIL"))
                return None

        return run

    return wrap


def sh(cmd: list[str], timeout: float = 60) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except Exception as err:
        return f"({type(err).__name__})"


@section("environment")
def environment() -> None:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "driver": sh(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
                "--format=csv,noheader",
            ]
        ),
        "nvcc": sh(["nvcc", "--version"]).splitlines()[-1:] or None,
        "cpu": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["sm"] = f"{p.major}.{p.minor}"
        env["multiprocessors"] = p.multi_processor_count
    RESULTS["environment"] = env
    for k, v in env.items():
        log(f"  {k}: {v}")


@section("build")
def build() -> None:
    t0 = time.perf_counter()
    name, reason = lmcache_cuda.backend_name(), lmcache_cuda.backend_reason()
    secs = time.perf_counter() - t0
    RESULTS["build"] = {"backend": name, "reason": reason, "seconds": round(secs, 1)}
    log(f"  backend: {name} ({reason}) in {secs:.1f} s")
    ok = name == "cuda-kernels"
    TABLE.append(
        (
            "lmcache_cuda build",
            f"{name}, {secs:.0f} s",
            "PASS" if ok else ("n/a (no GPU)" if not torch.cuda.is_available() else "FAIL"),
        )
    )


@section("tests/cuda")
def pytest_cuda(timeout: float) -> None:
    env = dict(os.environ)
    if torch.cuda.is_available():
        env["LMCACHE_CUDA_BACKEND"] = "cuda"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "connector"), str(ROOT / "cuda"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-rfEs", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    for line in out[-25:]:
        log("  " + line)
    summary = next((ln for ln in reversed(out) if " passed" in ln or " failed" in ln or " error" in ln), "no summary")
    RESULTS["pytest"] = {"rc": proc.returncode, "summary": summary, "seconds": round(time.perf_counter() - t0, 1)}
    TABLE.append(("pytest tests/cuda", summary.strip("= "), "PASS" if proc.returncode == 0 else "FAIL"))


class _Held:
    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t

    def release(self) -> None:
        pass


def _llama(tokens: int, device: str, layout: str = "LBNHC", layers: int = 32, seed: int = 0):
    """Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16, block 16: 128 KiB per
    token) with room for ``tokens`` tokens twice over."""
    blocks = max(64, 2 * -(-tokens // 16))
    return vllm_kv_caches(layout, layers, blocks, 8, 16, 256, torch.bfloat16, device, seed=seed)


@section("engine round trip")
def engine_round_trip(quick: bool) -> None:
    """Save chunks from CUDA KV into the engine's pool (CPU tier), read them back, load
    them into other blocks: every byte must land. Then the same with the host-side
    completion wait removed, to show the check can see the race it guards against."""
    from lmcache_core.config import load_config
    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.plugins import PluginManager

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    n_chunks = 6 if quick else 12
    rounds = 2 if quick else 4
    for kind in ("token", "block"):
        for wait in (True, False):
            if not wait and device == "cpu":
                continue
            src = _llama(256 * n_chunks, device, seed=1)
            dst = poison_like(src, 2)

            def make(kv: dict) -> Any:
                return TokenLayout(kv, 16, allow_cpu=True) if kind == "token" else BlockLayout(kv, 16)

            a, b, ref = make(src), make(dst), make(src)
            loaded = load_config(env={}, overrides={"chunk_size": 256, "backends": [{"name": "local_cpu", "max_size": "2GiB"}]})
            eng = CacheEngine(
                loaded, namespace=KeyNamespace(model=f"gpu-check-{kind}-{wait}"), plugins=PluginManager(load_entry_points=False)
            )
            g = torch.Generator().manual_seed(3)
            nb = next(iter(src.values())).shape[0]
            shape = a.chunk_shape(256)
            stored_bad = loaded_bad = total = 0
            for r in range(rounds):
                table_s = torch.randperm(nb, generator=g)[: 16 * n_chunks].tolist()
                table_d = torch.randperm(nb, generator=g)[: 16 * n_chunks].tolist()
                hashes = [bytes([r, i, int(wait)]) * 5 + b"x" for i in range(n_chunks)]
                expected = []
                for i, h in enumerate(hashes):
                    ids = table_s[i * 16 : (i + 1) * 16]
                    on_dev = torch.empty(shape, dtype=a.dtype, device=device)
                    ref.save_chunk(ids, 0, 256, on_dev)  # the truth, gathered on the device
                    expected.append(int_view(on_dev).cpu())
                    buf = eng.allocate(shape, a.dtype)
                    assert buf is not None, "pool exhausted"
                    a.save_chunk(ids, 0, 256, buf.tensor, wait=wait)
                    # what the CPU tier, the canary or a write-behind reads at once:
                    stored_bad += int(not torch.equal(int_view(buf.tensor), expected[i]))
                    eng.store_hashes([h], [buf], n_tokens=256)
                    buf.release()
                    if device == "cuda":
                        torch.cuda.synchronize()
                for i, h in enumerate(hashes):
                    got = eng.retrieve_buffer(h, shape, a.dtype)
                    assert got is not None, "chunk missing from the CPU tier"
                    # a chunk read from a remote tier lands in a temporary pool buffer,
                    # which goes back to the pool right after the load
                    tmp = eng.allocate(shape, a.dtype)
                    tmp.tensor.copy_(got.tensor)
                    got.release()
                    b.load_chunk(tmp.tensor, table_d[i * 16 : (i + 1) * 16], 0, 256, 0, wait=wait)
                    tmp.tensor.view(torch.uint8).fill_(0xA5)  # ...and is reused at once
                    tmp.release()
                if device == "cuda":
                    torch.cuda.synchronize()
                for i in range(n_chunks):
                    back = torch.empty(shape, dtype=a.dtype, device=device)
                    make(dst).save_chunk(table_d[i * 16 : (i + 1) * 16], 0, 256, back)
                    total += 1
                    loaded_bad += int(not torch.equal(int_view(back).cpu(), expected[i]))
            eng.close()
            results[f"{kind}/{'wait' if wait else 'no-wait'}"] = {
                "chunks": total,
                "stored_wrong": stored_bad,
                "loaded_wrong": loaded_bad,
            }
            log(
                f"  {kind:5} {'with' if wait else 'WITHOUT (control)'} the completion wait: "
                f"{stored_bad} of {total} saved chunks wrong when read at once, {loaded_bad} of {total} loaded chunks wrong"
            )
            bad = stored_bad + loaded_bad
            if wait:
                TABLE.append(
                    (
                        f"engine round trip ({kind})",
                        f"{bad} of {2 * total} saved+loaded chunks wrong",
                        "PASS" if bad == 0 else "FAIL",
                    )
                )
            else:
                TABLE.append((f"  control: no wait ({kind})", f"{bad} of {2 * total} wrong (should be > 0)", "info"))
    RESULTS["engine"] = results


def _wall(fn: Callable[[], object], iters: int, sync: bool) -> float:
    for _ in range(2):
        fn()
    if sync:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@section("speed")
def speed(quick: bool) -> None:
    if not torch.cuda.is_available():
        log("  no GPU: skipped")
        return
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


def _matmul_layer(n: int, reps: int) -> Callable[[], None]:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def layer() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    return layer


@section("layerwise")
def layerwise(quick: bool) -> None:
    """A simulated forward of 32 layers (bf16 matmuls per layer, sized against the
    load time) with the chunks' loads overlapped layer by layer, and the same for saves;
    share of the transfer time hidden = (compute + transfer - pipelined) / transfer."""
    if not torch.cuda.is_available():
        log("  no GPU: skipped (tests/cuda/test_adapters.py runs the pipeline on CPU)")
        return
    tokens = 1024 if quick else 2048  # 128 / 256 MiB of KV in chunks of 256 tokens
    kv = _llama(tokens, "cuda", seed=5)
    src = _llama(tokens, "cuda", seed=6)
    names = list(kv)
    nb = next(iter(kv.values())).shape[0]
    table = torch.randperm(nb)[: tokens // 16].tolist()
    chunks = [(c * 256, (c + 1) * 256) for c in range(tokens // 256)]
    want = {n: int_view(src[n][table]).clone() for n in names}
    iters = 3 if quick else 5
    one = _matmul_layer(2048, 1)
    t_mm = _wall(one, 20, True)
    # A layer of a prefill forward is GPU-bound: one matmul per layer, sized so its GPU
    # time is the case's share of the load time (the host launches it in ~30 us). The
    # last case keeps the earlier model, several 2048 matmuls per layer, whose launches
    # cost the host more than the GPU takes (a host-bound forward), for comparison.
    mm_gpu = {n: _time_cuda(_matmul_layer(n, 1), 10) for n in range(1024, 8193, 512)}
    out: dict[str, Any] = {
        "tokens": tokens,
        "matmul_2048_us": round(t_mm * 1e6, 1),
        "matmul_gpu_us": {n: round(t * 1e6, 1) for n, t in mm_gpu.items()},
    }
    log(f"  matmul GPU time (us) by size: {out['matmul_gpu_us']}")
    cases = [
        ("token", 4.0, "gpu"),
        ("token", 2.0, "gpu"),
        ("token", 1.0, "gpu"),
        ("token", 0.5, "gpu"),
        ("block", 2.0, "gpu"),
        ("block", 1.0, "gpu"),
        ("token", 2.0, "host"),
    ]
    # The pipeline as the connector runs it (a high-priority side stream; save_kv_layer
    # enqueues the next layers' loads after each layer's compute), then two variants
    # for comparison: loads enqueued from wait_for_layer_load only, a normal-priority
    # stream.
    variants = {
        "default": {"priority": -1, "after": True},
        "wait-only": {"priority": -1, "after": False},
        "priority-0": {"priority": 0, "after": True},
    }
    for kind, ratio, bound in cases:
        lay = TokenLayout(kv, 16) if kind == "token" else BlockLayout(kv, 16)
        src_lay = TokenLayout(src, 16) if kind == "token" else BlockLayout(src, 16)
        bufs = []
        for lo, hi in chunks:
            t = torch.empty(lay.chunk_shape(hi - lo), dtype=lay.dtype, pin_memory=True)
            src_lay.save_chunk(table, lo, hi, t)
            bufs.append(t)

        def load_all() -> None:
            for t, (lo, hi) in zip(bufs, chunks):
                lay.load_chunk(t, table, lo, hi, 0, wait=False)
            lay.finish()

        t_load = _wall(load_all, iters, True)
        target = ratio * t_load / len(names)
        if bound == "gpu":
            size = min(mm_gpu, key=lambda n: abs(mm_gpu[n] - target))
            layer = _matmul_layer(size, 1)
        else:
            size = 2048
            layer = _matmul_layer(2048, max(1, round(target / t_mm)))

        def compute() -> None:
            for _ in names:
                layer()

        t_c = _wall(compute, iters, True)
        wrong = [0]
        host = [0.0]
        pipe = LayerPipeline(lay, names)
        after = True

        load_host: list[float] = []

        def pipelined(check: bool = False) -> None:
            h0 = time.perf_counter()
            pipe.load([LoadItem(_Held(t), table, lo, hi, 0) for t, (lo, hi) in zip(bufs, chunks)])
            spent = time.perf_counter() - h0
            load_host.append(spent)
            for n in names:
                h0 = time.perf_counter()
                pipe.wait_layer(n)
                spent += time.perf_counter() - h0
                if check:
                    wrong[0] += int(not torch.equal(int_view(kv[n][table]), want[n]))
                layer()
                if after:  # the connector's save_kv_layer
                    h0 = time.perf_counter()
                    pipe.after_layer(n)
                    spent += time.perf_counter() - h0
            pipe.end_loads()
            host[0] = spent

        others = {}
        for vname, v in variants.items():
            if vname == "default":
                continue
            pipe, after = LayerPipeline(lay, names, priority=v["priority"]), v["after"]
            t_v = _wall(pipelined, iters, True)
            others[vname] = round((t_c + t_load - t_v) / t_load, 3)
        pipe, after = LayerPipeline(lay, names), True
        load_host.clear()
        t_p = _wall(pipelined, iters, True)
        if TRACE_DIR is not None and kind == "token" and ratio == 1.0 and bound == "gpu":
            _trace(pipelined, TRACE_DIR / "layerwise_trace.json")
        for t in kv.values():
            int_view(t).zero_()
        pipelined(check=True)
        torch.cuda.synchronize()
        hidden = (t_c + t_load - t_p) / t_load
        row = {
            "compute_over_load": round(t_c / t_load, 2),
            "forward": f"{bound}-bound, matmul {size}",
            "load_ms": round(t_load * 1e3, 2),
            "compute_ms": round(t_c * 1e3, 2),
            "pipelined_ms": round(t_p * 1e3, 2),
            "serial_ms": round((t_c + t_load) * 1e3, 2),
            "hidden_share": round(hidden, 3),
            "layers_wrong": wrong[0],
            "host_enqueue_ms": round(host[0] * 1e3, 2),
            "host_load_call_ms": round(statistics.median(load_host) * 1e3, 3),
            "active": pipe.active,
            "hidden_share_variants": others,
        }
        out[f"load/{kind}/c{ratio}/{bound}"] = row
        log(f"  {kind} loads, compute/load {t_c / t_load:.2f}: {row}")
        goal = hidden >= HIDE_GOAL if t_c > t_load and bound == "gpu" else None
        verdict = "FAIL" if wrong[0] or not pipe.active else ("PASS" if goal else ("MISS" if goal is False else "info"))
        TABLE.append(
            (
                f"layerwise {kind} load, compute/load {t_c / t_load:.2f}{'' if bound == 'gpu' else ' (host-bound fwd)'}",
                f"{hidden:.0%} hidden, {t_p * 1e3:.1f} vs {(t_c + t_load) * 1e3:.1f} ms serial, host {host[0] * 1e3:.1f} ms"
                f" (wait-only {others['wait-only']:.0%}, priority 0 {others['priority-0']:.0%})",
                verdict,
            )
        )
        save_bufs = [torch.empty(lay.chunk_shape(hi - lo), dtype=lay.dtype, pin_memory=True) for lo, hi in chunks]

        def save_all() -> None:
            for t, (lo, hi) in zip(save_bufs, chunks):
                lay.save_chunk(table, lo, hi, t, wait=False)
            lay.finish()

        t_save = _wall(save_all, iters, True)

        def pipelined_saves() -> None:
            items = [SaveItem(_Held(t), table, lo, hi) for t, (lo, hi) in zip(save_bufs, chunks)]
            for n in names:
                layer()
                pipe.save_layer(n, lambda: items)
            pipe.end_saves()

        t_ps = _wall(pipelined_saves, iters, True)
        hidden_s = (t_c + t_save - t_ps) / t_save
        out[f"save/{kind}/c{ratio}/{bound}"] = {
            "compute_over_save": round(t_c / t_save, 2),
            "save_ms": round(t_save * 1e3, 2),
            "pipelined_ms": round(t_ps * 1e3, 2),
            "hidden_share": round(hidden_s, 3),
        }
        log(
            f"  {kind} saves, compute/save {t_c / t_save:.2f}: save {t_save * 1e3:.1f} ms, pipelined {t_ps * 1e3:.1f} vs serial {(t_c + t_save) * 1e3:.1f} ms: {hidden_s:.0%} hidden"
        )
        TABLE.append(
            (
                f"layerwise {kind} save, compute/save {t_c / t_save:.2f}{'' if bound == 'gpu' else ' (host-bound fwd)'}",
                f"{hidden_s:.0%} hidden",
                "info" if t_c <= t_save or bound != "gpu" else ("PASS" if hidden_s >= HIDE_GOAL else "MISS"),
            )
        )
        # saved bytes equal a plain gather after the forward
        items = [
            SaveItem(_Held(torch.empty(lay.chunk_shape(hi - lo), dtype=lay.dtype, pin_memory=True)), table, lo, hi)
            for lo, hi in chunks
        ]
        pipe = LayerPipeline(lay, names)
        for n in names:
            pipe.save_layer(n, lambda: items)
        saved = pipe.end_saves()
        ref = torch.empty(lay.chunk_shape(256), dtype=lay.dtype, pin_memory=True)
        bad = 0
        for s in saved:
            lay.save_chunk(table, s.lo, s.hi, ref)
            bad += int(not torch.equal(int_view(ref), int_view(s.buf.tensor)))
        out[f"saved_wrong/{kind}/c{ratio}/{bound}"] = bad
        if bad:
            TABLE.append((f"layerwise {kind} saves bit-exact", f"{bad}/{len(saved)} chunks wrong", "FAIL"))
    wrong_saves = sum(v for k, v in out.items() if k.startswith("saved_wrong/"))
    if not wrong_saves:
        TABLE.append(("layerwise saves bit-exact", f"0 wrong chunks in {len(cases)} cases", "PASS"))
    RESULTS["layerwise"] = out


TRACE_DIR: Path | None = None


def _trace(fn: Callable[[], None], path: Path) -> None:
    """A torch.profiler trace of one call (chrome format) and its op table."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=40))
    log(f"  trace: {path} ({path.stat().st_size >> 10} KiB)")


@section("profile")
def profile() -> None:
    """Where one chunk copy's time goes (2 MiB and 32 MiB, token and block adapters):
    cProfile of the Python path, and torch.profiler's CPU/CUDA op table."""
    if not torch.cuda.is_available():
        log("  no GPU: skipped")
        return
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for tokens in (16, 256):
        kv = _llama(8 * tokens, "cuda", seed=9)
        nb = next(iter(kv.values())).shape[0]
        table = torch.randperm(nb)[: -(-tokens // 16)].tolist()
        for kind in ("token", "block"):
            lay = TokenLayout(kv, 16) if kind == "token" else BlockLayout(kv, 16)
            host = torch.empty(lay.chunk_shape(tokens), dtype=lay.dtype, pin_memory=True)
            for _ in range(5):
                lay.save_chunk(table, 0, tokens, host)
            n = 50
            pr = cProfile.Profile()
            t0 = time.perf_counter()
            pr.enable()
            for _ in range(n):
                lay.save_chunk(table, 0, tokens, host)
            pr.disable()
            per = (time.perf_counter() - t0) / n
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
            log(f"\n--- {kind} save_chunk, {tokens} tokens: {per * 1e6:.0f} us per call (under cProfile) ---")
            log("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[-2600:])
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    lay.save_chunk(table, 0, tokens, host)
            log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    # the layer pipeline's host side: 8 chunks of 256 tokens, 32 layers, no compute
    kv = _llama(2048, "cuda", seed=10)
    nb = next(iter(kv.values())).shape[0]
    table = torch.randperm(nb)[:128].tolist()
    for kind in ("token", "block"):
        lay = TokenLayout(kv, 16) if kind == "token" else BlockLayout(kv, 16)
        bufs = [torch.empty(lay.chunk_shape(256), dtype=lay.dtype, pin_memory=True) for _ in range(8)]
        pipe = LayerPipeline(lay, list(kv))

        def step() -> None:
            pipe.load([LoadItem(_Held(t), table, c * 256, (c + 1) * 256, 0) for c, t in enumerate(bufs)])
            for n in kv:
                pipe.wait_layer(n)
            pipe.end_loads()

        for _ in range(3):
            step()
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        for _ in range(5):
            step()
        pr.disable()
        log(
            f"\n--- layer pipeline ({kind}), 8 chunks x 32 layers: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms per step (under cProfile) ---"
        )
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
        log("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[-2600:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        default=os.environ.get("OUT", str(ROOT / "bench" / "results")),
        help="where gpu_check.json goes (default $OUT, else bench/results/, which git ignores)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pytest-timeout", type=float, default=300)
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument(
        "--only", nargs="+", choices=["pytest", "engine", "speed", "layerwise", "profile"], help="run these sections only"
    )
    p.add_argument("--trace", action="store_true", help="write a torch.profiler trace of one pipelined step to --out")
    a = p.parse_args(argv)
    global TRACE_DIR
    if a.trace:
        TRACE_DIR = Path(a.out)
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not torch.cuda.is_available():
        log("gpu_check: no CUDA GPU visible: a dry run of the CPU parts")
    environment()
    build()
    want = set(a.only or ["pytest", "engine", "speed", "layerwise"])
    if "pytest" in want and not a.skip_pytest:
        pytest_cuda(a.pytest_timeout)
    if "layerwise" in want:
        layerwise(a.quick)
    if "speed" in want:
        speed(a.quick)
    if "engine" in want:
        engine_round_trip(a.quick)
    if "profile" in want:
        profile()
    RESULTS["table"] = TABLE
    RESULTS["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    env = RESULTS.get("environment", {})
    log(
        f"\n=== summary: {env.get('gpu')} | driver {env.get('driver')} | torch {env.get('torch')} CUDA {env.get('torch_cuda')} | {RESULTS['seconds']} s ==="
    )
    w = max(len(c) for c, _, _ in TABLE) if TABLE else 10
    for check, fig, verdict in TABLE:
        log(f"{check:<{w}}  {verdict:<6} {fig}")
    failed = [c for c, _, v in TABLE if v == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
