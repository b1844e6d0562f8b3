"""The profile section: where one chunk copy's host time goes (cProfile, torch.profiler)
and the layer pipeline's host side."""

from __future__ import annotations

import time

import torch
from lmcache_connector.layouts.kv_adapters import BlockLayout, TokenLayout
from lmcache_connector.transfers.layerwise import LayerPipeline, LoadItem

from .common import _Held, _llama, log, section


@section("profile", gpu_only="")
def profile() -> None:
    """Where one chunk copy's time goes (2 MiB and 32 MiB, token and block adapters):
    cProfile of the Python path, and torch.profiler's CPU/CUDA op table."""
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
