"""What sealing frames (``frame_secret``) costs: the MAC's speed on this CPU next to
the plain checksum, a memory copy and the other keyed hashes we could have used, then
the tiers' own read throughput with and without a secret, side by side.

    python bench/bench_frame_mac.py [--quick] [--tiers disk shm redis]

Part 1, per chunk size: GB/s of a memory copy, XXH3-64 (the plain checksum), keyed
BLAKE3 (the MAC), HMAC-SHA256 and keyed BLAKE2b (best of several runs, one core).
Part 2: ``get_many`` of N chunks (2 MiB of float16 each) from the disk tier (page
cache), the peer tier's shared-memory path (a node in this process on a Unix socket)
and Redis (``redis-server`` on loopback, if installed): plain frames vs sealed frames,
medians of alternating rounds, and sealed/plain time. Never part of the test pass.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blake3  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from lib.servers import redis_server  # noqa: E402
from lmcache_core.backend import StorageBackend  # noqa: E402
from lmcache_core.testing import make_context, random_key  # noqa: E402

SECRET = "bench-frame-secret-0123456789abcdef"
CHUNK_SHAPE = (32, 2, 256, 64)  # 2 MiB of float16: a 256-token chunk of a small model


def best_rate(fn: Callable[[], Any], nbytes: int, budget_s: float) -> float:
    """GB/s of the fastest of repeated runs within ``budget_s``."""
    best = float("inf")
    end = time.perf_counter() + budget_s
    runs = 0
    while runs < 3 or time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        runs += 1
    return nbytes / best / 1e9


def hash_rates(sizes: list[int], budget_s: float) -> None:
    key = os.urandom(32)
    print(
        f"{'chunk':>8}  " + "  ".join(f"{n:>13}" for n in ("memcpy", "xxh3-64", "blake3 keyed", "hmac-sha256", "blake2b keyed"))
    )
    for n in sizes:
        src = np.frombuffer(os.urandom(n), dtype=np.uint8)
        dst = np.empty_like(src)
        fns = {
            "memcpy": lambda: np.copyto(dst, src),
            "xxh3": lambda: xxhash.xxh3_64(src).hexdigest(),
            "blake3": lambda: blake3.blake3(src, key=key).hexdigest(),
            "hmac": lambda: hmac.new(key, src, hashlib.sha256).hexdigest(),
            "blake2b": lambda: hashlib.blake2b(src, key=key).hexdigest(),
        }
        rates = {k: best_rate(f, n, budget_s) for k, f in fns.items()}
        print(f"{n >> 10:>6}Ki  " + "  ".join(f"{r:>9.2f} GB/s" for r in rates.values()))


def disk_tier(tmp: Path, secret: str | None) -> StorageBackend:
    from lmcache_backend_disk import DiskBackend, create_disk_backend

    b = create_disk_backend(
        {"path": str(tmp / f"disk-{secret is not None}"), "max_size": "4GiB", "fsync": False}, make_context(frame_secret=secret)
    )
    assert isinstance(b, DiskBackend) and b.wait_for_scan(60)
    return b


def make_shm(stack: ExitStack, tmp: Path) -> Callable[[str | None], StorageBackend]:
    from lmcache_backend_peer import PeerServer, create_peer_backend
    from lmcache_backend_peer.shm import ArenaStore

    store = ArenaStore(2 << 30, [None])
    stack.callback(store.close)
    sock = str(tmp / "node.sock")
    server = PeerServer(store, ("127.0.0.1", 0), b"bench-node-secret-0123456789", writable=True, unix_socket=sock, timeout=30)
    stack.callback(server.close)

    def make(secret: str | None) -> StorageBackend:
        cfg = {"unix_socket": sock, "secret": "bench-node-secret-0123456789", "max_size": 0, "push": True, "timeout_s": 30.0}
        return create_peer_backend(cfg, make_context(pool_bytes=1 << 20, frame_secret=secret))

    return make


def make_redis(stack: ExitStack, tmp: Path) -> Callable[[str | None], StorageBackend]:
    from lmcache_backend_redis import create_redis_backend

    host, port = "127.0.0.1", stack.enter_context(redis_server(tmp))

    def make(secret: str | None) -> StorageBackend:
        section = {"url": f"redis://{host}:{port}/0", "prefix": f"mac-{secret is not None}:"}
        return create_redis_backend(section, make_context(frame_secret=secret))

    return make


def tier_reads(tiers: list[str], n: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(CHUNK_SHAPE, generator=g).to(torch.float16) for _ in range(n)]
    keys = {arm: [random_key(f"mac-bench-{arm}") for _ in range(n)] for arm in ("plain", "sealed")}  # one node serves both arms
    mib = n * chunks[0].nbytes / 2**20
    print(f"\n{n} chunks of {chunks[0].nbytes >> 20} MiB ({mib:.0f} MiB), get_many, medians of {rounds} alternating rounds")
    print(f"{'tier':<8} {'plain':>10} {'sealed':>10} {'plain GB/s':>11} {'sealed GB/s':>12} {'sealed/plain':>13}")
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        for tier in tiers:
            if tier == "disk":
                make: Callable[[str | None], StorageBackend] = lambda s: disk_tier(tmp, s)  # noqa: E731
            elif tier == "shm":
                make = make_shm(stack, tmp)
            elif tier == "redis":
                try:
                    make = make_redis(stack, tmp)
                except SystemExit as err:
                    print(f"{tier:<8} skipped: {err}")
                    continue
            else:
                raise SystemExit(f"unknown tier {tier}")
            arms = {"plain": make(None), "sealed": make(SECRET)}
            for b in arms.values():
                stack.callback(b.close)
            outs = [torch.empty_like(c) for c in chunks]
            times: dict[str, list[float]] = {k: [] for k in arms}
            for arm, b in arms.items():
                assert all(b.put_many(list(zip(keys[arm], chunks)))), f"{tier}/{arm}: put failed"
            for _ in range(rounds):
                for arm, b in arms.items():
                    t = time.perf_counter()
                    got = b.get_many(keys[arm], outs)
                    times[arm].append(time.perf_counter() - t)
                    assert all(got) and torch.equal(outs[-1], chunks[-1]), f"{tier}/{arm}: read failed"
            p, s = statistics.median(times["plain"]), statistics.median(times["sealed"])
            gb = n * chunks[0].nbytes / 1e9
            print(f"{tier:<8} {p * 1e3:>8.1f}ms {s * 1e3:>8.1f}ms {gb / p:>11.2f} {gb / s:>12.2f} {s / p:>13.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes, chunks and rounds")
    ap.add_argument("--tiers", nargs="+", default=["disk", "shm", "redis"])
    args = ap.parse_args(argv)
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    sizes = [256 << 10, 2 << 20] if args.quick else [64 << 10, 256 << 10, 2 << 20, 8 << 20]
    hash_rates(sizes, 0.5 if args.quick else 1.5)
    tier_reads(args.tiers, 8 if args.quick else 32, 3 if args.quick else 7)
    return 0


if __name__ == "__main__":
    sys.exit(main())
