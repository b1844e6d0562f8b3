"""Paged KV transfer throughput: CUDA kernels vs a plain pinned cudaMemcpy of the same
bytes (target: >= 0.8 of it) vs the pure-torch reference path, side by side.

    python bench/bench_cuda.py [--tokens 256 1024] [--layers 32] [--kv-heads 8] [--quick] ...

Needs a CUDA GPU; without one it says so, times the reference path on CPU for a sanity
figure, and exits 0. Never part of the test pass.
"""

from __future__ import annotations

import argparse
import sys

import torch

import lmcache_cuda
from lib.timing import time_cpu as _time_cpu
from lib.timing import time_cuda as _time_cuda
from lmcache_cuda import PagedLayout, kernels, reference
from lmcache_cuda.testing import DTYPES, ragged_slots, random_paged_kv

TARGET = 0.8


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="one small size, few iterations")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.iters = [256], min(a.iters, 5)
        if not torch.cuda.is_available():
            a.layers = min(a.layers, 8)
    return a


def _row(name: str, nbytes: int, secs: float, base: float | None, *, flag: bool = True) -> str:
    gbs = nbytes / secs / 1e9
    ratio = "" if base is None else f"{base / secs:6.2f}x memcpy"
    if base is not None and flag and base / secs < TARGET:
        ratio += "  < target"
    return f"  {name:<34} {secs * 1e6:10.1f} us {gbs:8.2f} GB/s  {ratio}"


def _setup(a: argparse.Namespace, tokens: int, device: str):
    dtype = DTYPES[a.dtype]
    needed = -(-tokens // a.block_size)
    kv = random_paged_kv(a.layers, 2 * needed + 8, a.kv_heads, a.block_size, a.head_size, dtype, device)
    layout = PagedLayout.from_layers(kv)
    slots = ragged_slots(layout.num_blocks, a.block_size, tokens, seed=1).to(device)
    return kv, layout, slots


def run_cpu(a: argparse.Namespace) -> None:
    print(
        "bench_cuda: needs a CUDA GPU (torch.cuda.is_available() is False); "
        f"lmcache_cuda backend here: {lmcache_cuda.backend_name()} ({lmcache_cuda.backend_reason()})"
    )
    print("sanity figure: pure-torch reference on CPU (not a GPU result)")
    iters = min(a.iters, 5)
    for tokens in a.tokens:
        kv, layout, slots = _setup(a, tokens, "cpu")
        out = torch.empty(layout.token_buffer_shape(tokens), dtype=layout.dtype)
        nbytes = out.numel() * out.element_size()
        flat = torch.empty_like(out).view(-1)
        print(
            f"tokens={tokens} layers={a.layers} kv_heads={a.kv_heads} head_size={a.head_size} "
            f"block_size={a.block_size} {a.dtype}: {nbytes / 2**20:.1f} MiB"
        )
        base = _time_cpu(lambda: flat.copy_(out.view(-1)), iters)
        print(_row("memcpy (CPU, contiguous)", nbytes, base, None))
        for name, ref in (
            ("reference gather (CPU)", reference.gather_tokens),
            ("reference scatter (CPU)", reference.scatter_tokens),
        ):
            print(_row(name, nbytes, _time_cpu(lambda ref=ref: ref(kv, slots, out), iters), base, flag=False))


def run_gpu(a: argparse.Namespace) -> int:
    dev = "cuda"
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} CUDA {torch.version.cuda}")
    print(f"lmcache_cuda backend: {lmcache_cuda.backend_name()} ({lmcache_cuda.backend_reason()})")
    have_kernels = lmcache_cuda.available()
    worst = None
    for tokens in a.tokens:
        kv, layout, slots = _setup(a, tokens, dev)
        shape = layout.token_buffer_shape(tokens)
        host = torch.empty(shape, dtype=layout.dtype, pin_memory=True)
        on_dev = torch.empty(shape, dtype=layout.dtype, device=dev)
        nbytes = host.numel() * host.element_size()
        print(
            f"\ntokens={tokens} layers={a.layers} kv_heads={a.kv_heads} head_size={a.head_size} "
            f"block_size={a.block_size} {a.dtype}: {nbytes / 2**20:.1f} MiB per transfer"
        )
        d2h = _time_cuda(lambda: host.copy_(on_dev, non_blocking=True), a.iters)
        h2d = _time_cuda(lambda: on_dev.copy_(host, non_blocking=True), a.iters)
        print(_row("memcpy D2H pinned (baseline)", nbytes, d2h, None))
        rows = []
        if have_kernels:
            rows += [
                ("kernel gather -> pinned", d2h, lambda: kernels.gather_tokens(kv, slots, host)),
                ("kernel gather -> device", None, lambda: kernels.gather_tokens(kv, slots, on_dev)),
            ]
        rows += [("reference gather -> pinned", d2h, lambda: reference.gather_tokens(kv, slots, host))]
        for name, base, fn in rows:
            secs = _time_cuda(fn, a.iters)
            print(_row(name, nbytes, secs, base))
            if base is not None and name.startswith("kernel"):
                worst = min(worst or 9e9, base / secs)
        print(_row("memcpy H2D pinned (baseline)", nbytes, h2d, None))
        rows = []
        if have_kernels:
            rows += [("kernel scatter <- pinned", h2d, lambda: kernels.scatter_tokens(kv, slots, host))]
        rows += [("reference scatter <- pinned", h2d, lambda: reference.scatter_tokens(kv, slots, host))]
        for name, base, fn in rows:
            secs = _time_cuda(fn, a.iters)
            print(_row(name, nbytes, secs, base))
            if name.startswith("kernel"):
                worst = min(worst or 9e9, base / secs)
        ids = torch.unique(slots // a.block_size)
        bshape = (a.layers, ids.numel(), layout.block_numel)
        bhost = torch.empty(bshape, dtype=layout.dtype, pin_memory=True)
        bdev = torch.empty(bshape, dtype=layout.dtype, device=dev)
        bbytes = bhost.numel() * bhost.element_size()
        bd2h = _time_cuda(lambda: bhost.copy_(bdev, non_blocking=True), a.iters)
        print(_row(f"memcpy D2H pinned ({ids.numel()} blocks)", bbytes, bd2h, None))
        if have_kernels:
            secs = _time_cuda(lambda: kernels.gather_blocks(kv, ids, bhost), a.iters)
            print(_row("kernel block gather -> pinned", bbytes, secs, bd2h))
            worst = min(worst or 9e9, bd2h / secs)
        print(
            _row(
                "reference block gather -> pinned",
                bbytes,
                _time_cuda(lambda: reference.gather_blocks(kv, ids, bhost), a.iters),
                bd2h,
            )
        )
    if not have_kernels:
        print("\nkernels unavailable: only the reference path was measured")
        return 0
    verdict = "meets" if worst >= TARGET else "MISSES"
    print(f"\nworst kernel/memcpy ratio: {worst:.2f} ({verdict} the {TARGET} target)")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if not torch.cuda.is_available():
        run_cpu(a)
        return 0
    return run_gpu(a)


if __name__ == "__main__":
    sys.exit(main())
