"""Benchmark: the s3 tier vs plain single-stream boto3, against moto on loopback.

    python bench/bench_s3.py [--quick]

Starts moto's ThreadedMotoServer on 127.0.0.1 in a child process (a Python S3 emulator, so
absolute numbers say little about real S3; the ratios show what the tier's batching,
parallel HEADs, multipart uploads and ranged GETs buy over one request at a time).
The same bytes go through both paths: the baseline uploads the very frames the tier
would write (``put_object``) and reads them back (``get_object``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

os.environ.update(
    AWS_ACCESS_KEY_ID="bench",
    AWS_SECRET_ACCESS_KEY="bench",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)

import boto3  # noqa: E402
import torch  # noqa: E402
from botocore.config import Config  # noqa: E402

from lib.servers import start_moto, stop_moto  # noqa: E402
from lmcache_backend_s3 import create_s3_backend  # noqa: E402
from lmcache_core.keys import KeyNamespace  # noqa: E402
from lmcache_core.serde import RawCodec, encode  # noqa: E402
from lmcache_core.testing import make_context  # noqa: E402


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(reps: int, base: Callable[[], Any], tier: Callable[[], Any]) -> tuple[float, float]:
    """Median seconds of ``base`` and ``tier``, run alternately so drift hits both."""
    b, t = [], []
    for _ in range(reps):
        b.append(timed(base))
        t.append(timed(tier))
    return statistics.median(b), statistics.median(t)


def row(name: str, nbytes: int, base_s: float, tier_s: float) -> None:
    if nbytes:
        b, t, unit = nbytes / base_s / 1e6, nbytes / tier_s / 1e6, "MB/s"
    else:
        b, t, unit = base_s * 1e3, tier_s * 1e3, "ms"
    print(f"{name:<46} {b:>10.1f} {t:>10.1f} {unit:<5} {base_s / tier_s:>9.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    args = ap.parse_args()
    chunk_mib, n_chunks, big_mib, reps = (1, 8, 24, 3) if args.quick else (4, 16, 64, 5)

    # The server runs in its own process, so it does not share the benchmark's GIL.
    server, endpoint = start_moto()
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=32),
    )
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    ctx = make_context(pool_bytes=1 << 20)
    ns = KeyNamespace(model="bench")
    opened: list[Any] = []

    def tier(prefix: str, **opts: Any) -> Any:
        section = {
            "bucket": bucket,
            "endpoint_url": endpoint,
            "addressing_style": "path",
            "prefix": prefix,
            "read_timeout_s": 60,
            "check_exists_before_put": False,
            **opts,
        }
        opened.append(create_s3_backend(section, ctx))
        return opened[-1]

    chunk_elems = chunk_mib * 2**20 // 2
    chunks = [(ns.key(os.urandom(16)), torch.randn(chunk_elems).to(torch.float16)) for _ in range(n_chunks)]
    frames = [encode(k, t, RawCodec()) for k, t in chunks]
    total = sum(t.nbytes for _, t in chunks)
    outs = [torch.empty_like(d) for _, d in chunks]

    print(f"s3 tier vs single-stream boto3, against moto ThreadedMotoServer at {endpoint} (loopback, separate process)")
    print(
        f"{n_chunks} chunks x {chunk_mib} MiB fp16 and one {big_mib} MiB chunk; median of {reps} alternating runs; "
        f"{os.cpu_count()} CPUs shared by client and server"
    )
    print(f"{'operation':<46} {'boto3':>10} {'tier':>10} {'unit':<5} {'tier/boto3':>10}")

    def base_puts() -> None:
        for i, f in enumerate(frames):
            client.put_object(Bucket=bucket, Key=f"base/{i}", Body=f)

    def base_gets() -> None:
        for i in range(n_chunks):
            client.get_object(Bucket=bucket, Key=f"base/{i}")["Body"].read()

    # 1. one caller (how the engine's write-behind thread and retrieve call a tier)
    # Each run gets a fresh tier (built before timing): a tier skips keys it knows present.
    fresh = iter([tier("seq") for _ in range(reps)])
    b, t = compare(reps, base_puts, lambda: [tp.put(k, d) for tp in [next(fresh)] for k, d in chunks])
    row(f"put, 1 caller, {chunk_mib} MiB chunks", total, b, t)
    t2 = tier("seq")
    b, t = compare(reps, base_gets, lambda: [t2.get(k, o) for (k, _), o in zip(chunks, outs)])
    assert all(torch.equal(o, d) for o, (_, d) in zip(outs, chunks))
    row(f"get, 1 caller, {chunk_mib} MiB chunks", total, b, t)

    # 2. four callers sharing one tier (thread-safe client, pooled connections)
    with ThreadPoolExecutor(4) as ex:
        fresh = iter([tier("par", max_concurrency=16) for _ in range(reps)])

        def put4() -> None:
            tp = next(fresh)
            list(ex.map(lambda kd: tp.put(*kd), chunks))

        b, t = compare(reps, base_puts, put4)
        row("put, 4 callers on one tier", total, b, t)
        b, t = compare(reps, base_gets, lambda: list(ex.map(lambda i: t2.get(chunks[i][0], outs[i]), range(n_chunks))))
        row("get, 4 callers on one tier", total, b, t)

    # 3. one large chunk: multipart upload and parallel ranged GETs vs one request
    big_key, big = ns.key(os.urandom(16)), torch.randn(big_mib * 2**20 // 2).to(torch.float16)
    big_frame = encode(big_key, big, RawCodec())
    big_opts = {"multipart_threshold": "16MiB", "multipart_chunksize": "8MiB", "range_chunksize": "8MiB", "max_concurrency": 8}
    fresh = iter([tier("big", **big_opts) for _ in range(reps)])
    b, t = compare(
        reps,
        lambda: client.put_object(Bucket=bucket, Key="base/big", Body=big_frame),
        lambda: next(fresh).put(big_key, big),
    )
    row(f"put, one {big_mib} MiB chunk (multipart, 8 MiB parts)", big.nbytes, b, t)
    tb, big_out = tier("big", **big_opts), torch.empty_like(big)
    b, t = compare(
        reps, lambda: client.get_object(Bucket=bucket, Key="base/big")["Body"].read(), lambda: tb.get(big_key, big_out)
    )
    assert torch.equal(big_out, big)
    row(f"get, one {big_mib} MiB chunk (ranged, 8 MiB ranges)", big.nbytes, b, t)

    # 4. lookups: contains(128 keys) vs 128 sequential HEADs
    keys = [ns.key(os.urandom(16)) for _ in range(128)]
    small = torch.zeros(16, dtype=torch.float16)
    tw = tier("lookup", max_concurrency=16)
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: tw.put(k, small), keys))
    names = [tw.cfg.object_name(k.to_str()) for k in keys]

    def base_heads() -> None:
        for n in names:
            client.head_object(Bucket=bucket, Key=n)

    cold = [tier("lookup", max_concurrency=16) for _ in range(reps)]
    it = iter(cold)
    b, t = compare(reps, base_heads, lambda: next(it).contains(keys))
    row("contains(128 keys), cold: parallel HEADs", 0, b, t)
    b, t = compare(reps, base_heads, lambda: cold[0].contains(keys))
    row("contains(128 keys), warm: presence cache", 0, b, t)
    assert cold[0].contains(keys) == 128
    print(f"requests per cold contains(128 keys): {cold[1].stats().extra['requests'] - 1} (plus 1 HeadBucket at startup)")
    for o in opened:
        o.close()
    stop_moto(server)


if __name__ == "__main__":
    sys.exit(main())
