"""The layer pipeline: loads and saves overlapped layer by layer with a simulated
forward, the share of the transfer hidden, and the bytes checked."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from lmcache_connector.layouts.kv_adapters import BlockLayout, TokenLayout
from lmcache_connector.transfers.layerwise import LayerPipeline, LoadItem, SaveItem
from lmcache_cuda.paged_layout import int_view

from . import common
from .common import HIDE_GOAL, RESULTS, TABLE, _Held, _llama, _time_cuda, _wall, log, section


def _matmul_layer(n: int, reps: int) -> Callable[[], None]:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def layer() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    return layer


@section("layerwise", gpu_only="tests/cuda/test_adapters.py runs the pipeline on CPU")
def layerwise(quick: bool) -> None:
    """A simulated forward of 32 layers (bf16 matmuls per layer, sized against the
    load time) with the chunks' loads overlapped layer by layer, and the same for saves;
    share of the transfer time hidden = (compute + transfer - pipelined) / transfer."""
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
        if common.TRACE_DIR is not None and kind == "token" and ratio == 1.0 and bound == "gpu":
            _trace(pipelined, common.TRACE_DIR / "layerwise_trace.json")
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
