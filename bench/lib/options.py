"""Command-line options several benchmarks share, so that they mean the same in each."""

from __future__ import annotations

import argparse


def add_chunk_options(ap: argparse.ArgumentParser) -> None:
    """``--chunks``, ``--chunk-mib`` and ``--rounds`` of the tier throughput benchmarks
    (bench_peer, bench_mooncake), beside their own ``--quick`` (16 chunks, 2 rounds);
    read them with ``chunk_plan``."""
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=5)


def chunk_plan(args: argparse.Namespace) -> tuple[int, int, int]:
    """(chunks, rounds, bytes per chunk, even: float16 elements) the options ask for."""
    n, rounds = (16, 2) if args.quick else (args.chunks, args.rounds)
    return n, rounds, int(args.chunk_mib * (1 << 20)) // 2 * 2
