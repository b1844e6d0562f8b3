"""The ``fp8`` codec's speed and size on this CPU: encode and decode of a K/V chunk, in
GB/s of the raw chunk's bytes, next to a memory copy (``torch.clone``) of the same
bytes, with one thread (``torch.set_num_threads(1)``, the per-core figure) and with
torch's default thread count, in one run; and the frame's bytes against the chunk's.

    python bench/bench_fp8_codec.py [--layers 8] [--heads 8] [--head-size 64] [--rounds 5] [--dtype bfloat16]
                                    [--paths native torch]

Both implementations of the codec run in one process, one after the other: the fused
kernel (``lmcache_core/csrc/fp8_kernel.c``, what the codec uses wherever the package
was built with a C compiler) and the torch ops it falls back to (``LMCACHE_FP8_KERNEL=torch``).

The chunk is ``[layers, k/v, 256 tokens, heads, head_size]`` of random normal KV.
Encode is :func:`lmcache_core.serde.encode_parts` (codec and frame header, checksum
included), decode :func:`lmcache_core.serde.decode` into a preallocated ``out`` (the
tiers' path: checksum verified, then the codec). Each figure is the median of
``--rounds`` timed calls after one warm-up call. Target (issue #35): encode + decode
(the round trip, ``bytes / (t_encode + t_decode)``) >= 2 GB/s per core. Never part
of the test pass.
"""

from __future__ import annotations

import argparse
import os

import torch

from lib.timing import time_cpu as median_seconds
from lmcache_core import fp8_native
from lmcache_core.fp8 import Fp8Codec
from lmcache_core.keys import ChunkKey
from lmcache_core.serde import RawCodec, decode, encode, encode_parts

KEY = ChunkKey(b"\x00" * 16, b"\x01" * 16)
TARGET_GBPS = 2.0


def measure(x: torch.Tensor, rounds: int) -> dict[str, float]:
    codec = Fp8Codec()
    codecs = {"fp8": codec, "raw": RawCodec()}
    frame = encode(KEY, x, codec)
    out = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    t_copy = median_seconds(lambda: x.clone(), rounds)
    t_enc = median_seconds(lambda: encode_parts(KEY, x, codec), rounds)
    t_dec = median_seconds(lambda: decode(frame, codecs, expect_key=KEY, out=out), rounds)
    t_raw_dec = median_seconds(lambda: decode(encode(KEY, x, RawCodec()), codecs, out=out), rounds)
    gb = nbytes / 1e9
    return {
        "copy": gb / t_copy,
        "encode": gb / t_enc,
        "decode": gb / t_dec,
        "round_trip": gb / (t_enc + t_dec),
        "raw_frame_round_trip": gb / t_raw_dec,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--paths", nargs="+", default=["native", "torch"], choices=["native", "torch"])
    ap.add_argument("--quick", action="store_true", help="a smaller chunk and 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.rounds = 2, 2
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.layers, 2, 256, args.heads, args.head_size, generator=g).to(dtype)
    nbytes = x.numel() * x.element_size()
    frame = encode(KEY, x, Fp8Codec())
    print(f"chunk {list(x.shape)} {args.dtype}: {nbytes / 2**20:.1f} MiB raw")
    print(f"fp8 frame (header included): {len(frame)} bytes = {len(frame) / nbytes:.4f}x of the raw chunk")
    default_threads = torch.get_num_threads()
    rows = []
    for path in args.paths:
        os.environ[fp8_native.ENV] = path
        fp8_native.reset()
        if path == "native" and fp8_native.kernel() is None:
            raise SystemExit("the fp8 kernel is unavailable here")
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            rows.append((path, threads, measure(x, args.rounds)))
        torch.set_num_threads(default_threads)
    print()
    print(
        f"{'path':>6}  {'threads':>7}  {'copy GB/s':>9}  {'encode':>14}  {'decode':>14}  {'enc+dec':>14}  {'raw frame':>9}  target"
    )
    for path, threads, r in rows:
        cells = [f"{r[k]:6.2f} ({r[k] / r['copy']:.2f}x)" for k in ("encode", "decode", "round_trip")]
        verdict = ("PASS" if r["round_trip"] >= TARGET_GBPS else "MISS") if threads == 1 else "-"
        print(
            f"{path:>6}  {threads:>7}  {r['copy']:9.2f}  {cells[0]:>14}  {cells[1]:>14}  {cells[2]:>14}  "
            f"{r['raw_frame_round_trip']:9.2f}  {verdict}"
        )
    by = {(p, t): r for p, t, r in rows}
    for threads in sorted({1, default_threads}):
        if ("native", threads) in by and ("torch", threads) in by:
            gain = by[("native", threads)]["round_trip"] / by[("torch", threads)]["round_trip"]
            print(f"native / torch, enc+dec, {threads} thread(s): {gain:.2f}x")
    print(
        "\npath: native = the fused kernel (lmcache_core/csrc/fp8_kernel.c, built with the package), torch = the torch ops (LMCACHE_FP8_KERNEL=torch);"
    )
    print("GB/s of the raw chunk's bytes; (x) = ratio to the copy; enc+dec = bytes / (t_encode + t_decode);")
    print(f"raw frame = the raw codec's frame encode + decode, for reference; target: enc+dec >= {TARGET_GBPS} GB/s on 1 thread")


if __name__ == "__main__":
    main()
