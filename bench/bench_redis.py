"""Benchmark: the redis tier vs redis-py's own pipelined SET/GET of the same bytes.

    python bench/bench_redis.py [--quick] [--chunks N] [--chunk-mib M] [--reps R]

Starts its own ``redis-server`` on a free 127.0.0.1 port (no persistence) and moves
``N`` chunks of ``M`` MiB fp16 (default 64 x 4 MiB) both ways:

- baseline: one redis-py pipeline of ``SET`` (the very frames the tier writes, encoded
  beforehand, so the baseline does no framing work) and one pipeline of ``GET``;
- tier: ``put_many`` (an ``EXISTS`` pipeline, framing with checksums, a ``SET``
  pipeline) and ``get_many`` (``STRLEN`` + bounded ``GETRANGE``, checksum verified,
  decoded into the caller's tensors), plus one caller doing ``put`` / ``get`` per chunk.

Runs alternate (baseline, tier, baseline, ...) and the medians are compared; the
server is flushed before every put run, so both write into an empty database. The
issue's bar is tier/redis-py >= 0.7 for the batched rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import redis
import torch

from lib.servers import start_redis
from lmcache_backend_redis import create_redis_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.serde import RawCodec, encode
from lmcache_core.testing import make_context

BAR = 0.7


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(
    reps: int, base: Callable[[], Any], tier: Callable[[], Any], before: Callable[[], Any] = lambda: None
) -> tuple[float, float]:
    """Median seconds of ``base`` and ``tier``, run alternately so drift hits both."""
    b, t = [], []
    for _ in range(reps):
        before()
        b.append(timed(base))
        before()
        t.append(timed(tier))
    return statistics.median(b), statistics.median(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16 x 1 MiB, 3 repeats")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    n, mib, reps = (16, 1, 3) if args.quick else (args.chunks, args.chunk_mib, args.reps)

    tmp = tempfile.mkdtemp(prefix="lmc-bench-redis-")
    proc, port = start_redis(tmp)
    try:
        raw = redis.Redis(port=port, socket_timeout=120)
        url = f"redis://127.0.0.1:{port}/0"
        tier = create_redis_backend({"url": url, "prefix": "t:", "socket_timeout_s": 120}, make_context(pool_bytes=1 << 20))
        ns = KeyNamespace(model="bench")
        chunks = [(ns.key(os.urandom(16)), torch.randn(mib * 2**20 // 2).to(torch.float16)) for _ in range(n)]
        frames = [encode(k, d, RawCodec()) for k, d in chunks]
        total = sum(d.nbytes for _, d in chunks)
        outs = [torch.empty_like(d) for _, d in chunks]

        def base_put() -> None:
            pipe = raw.pipeline(transaction=False)
            for i, f in enumerate(frames):
                pipe.set(f"b:{i}", f)
            pipe.execute()

        def base_get() -> None:
            pipe = raw.pipeline(transaction=False)
            for i in range(n):
                pipe.get(f"b:{i}")
            pipe.execute()

        def base_put_1() -> None:
            for i, f in enumerate(frames):
                raw.set(f"b:{i}", f)

        def base_get_1() -> None:
            for i in range(n):
                raw.get(f"b:{i}")

        print(
            f"redis tier vs redis-py {redis.__version__} pipelines, redis-server on 127.0.0.1:{port} (loopback, no persistence)"
        )
        print(
            f"{n} chunks x {mib} MiB fp16; median of {reps} alternating runs; {os.cpu_count()} CPUs shared by client and server"
        )
        print(f"{'operation':<40} {'redis-py':>10} {'tier':>10} {'unit':<5} {'tier/redis-py':>13}")
        rows: list[tuple[str, float]] = []

        def row(name: str, b: float, t: float) -> None:
            ratio = b / t
            rows.append((name, ratio))
            print(f"{name:<40} {total / b / 1e6:>10.1f} {total / t / 1e6:>10.1f} {'MB/s':<5} {ratio:>12.2f}x")

        b, t = compare(reps, base_put, lambda: tier.put_many(chunks), before=raw.flushdb)
        row("put_many (pipelined SET)", b, t)
        base_put()
        assert tier.put_many(chunks) == [True] * n
        b, t = compare(reps, base_get, lambda: tier.get_many([k for k, _ in chunks], outs))
        assert all(torch.equal(o, d) for o, (_, d) in zip(outs, chunks))
        row("get_many (pipelined GET)", b, t)
        b, t = compare(reps, base_put_1, lambda: [tier.put(k, d) for k, d in chunks], before=raw.flushdb)
        row("put, one chunk per call", b, t)
        base_put_1()
        b, t = compare(reps, base_get_1, lambda: [tier.get(k, o) for (k, _), o in zip(chunks, outs)])
        assert all(torch.equal(o, d) for o, (_, d) in zip(outs, chunks))
        row("get, one chunk per call", b, t)
        s = tier.stats()
        assert s.errors == 0 and s.extra["corrupt"] == 0, s
        tier.close()
        worst = min(r for name, r in rows[:2])
        verdict = "PASS" if worst >= BAR else "FAIL"
        print(f"batched throughput ratio (worst of put_many/get_many): {worst:.2f}x, bar {BAR}x: {verdict}")
        return 0 if worst >= BAR else 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
