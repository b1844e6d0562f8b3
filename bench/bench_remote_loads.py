"""Loading a run of chunks from a shared tier across a network: the engine's path
(``CacheEngine.iter_chunks``: one ``get_many`` per window, read ahead) next to the
tier's raw batch call and to one ``get`` per chunk (what loads cost before), at 0, 1
and 20 ms of round-trip time.

    python bench/bench_remote_loads.py [--quick] [--tiers redis peer s3 mooncake] [--rtt 0 1 20] [--window-mib 4]

Redis (``redis-server``), a peer node over TCP (``lmcache-core serve``) and S3 (moto's
server, in a child process) are reached through ``bench/lib/latency_proxy.py``, which
delays every byte by half the round trip each way (the machines have no ``netem``)
and holds at most ``--window-mib`` in flight per direction of a connection (its
default, 4 MiB; a large value models a link with an unbounded window).
Mooncake's transfer engine opens its own connections, so there the tier's calls are
delayed by one round trip each instead (a tier wrapper: ``--mooncake`` rows say
"simulated").

Printed per tier and RTT: N chunks of ``--chunk-kib``, medians of ``--rounds``
alternating runs: raw ``get_many``, the engine path, one ``get`` per chunk; the engine
path in round trips (time / RTT), its bound ``3 RTT + bytes / throughput`` (+10%)
where throughput is the raw batch call's at RTT 0, PASS/MISS against it, and
engine/raw (target <= 1.2). Never part of the test pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GLOG_minloglevel", "2")
# moto accepts any credentials; boto3 wants some
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import torch  # noqa: E402

from lib import servers  # noqa: E402
from lib.latency_proxy import WINDOW_BYTES, LatencyProxy  # noqa: E402
from lmcache_core.config import load_config  # noqa: E402
from lmcache_core.engine import CacheEngine  # noqa: E402
from lmcache_core.keys import KeyNamespace  # noqa: E402


# -- services: each yields (target host:port or None, function RTT -> backend section) ------
@contextmanager
def redis_service(tmp: Path) -> Iterator[tuple[tuple[str, int], Callable[[str], dict[str, Any]]]]:
    with servers.redis_server(tmp) as port:
        yield ("127.0.0.1", port), lambda hp: {"name": "redis", "url": f"redis://{hp}/0"}


@contextmanager
def peer_service(tmp: Path) -> Iterator[tuple[tuple[str, int], Callable[[str], dict[str, Any]]]]:
    node = servers.start_cache_node(tmp, "4GiB")
    try:
        host, _, port = node.address.rpartition(":")
        yield (
            (host, int(port)),
            lambda hp: {
                "name": "peer",
                "peers": [hp],
                "push": True,
                "secret_file": str(node.secret_file),
                "max_size": 0,
                "timeout_s": 60.0,
            },
        )
    finally:
        servers.stop(node.proc)


@contextmanager
def s3_service(tmp: Path) -> Iterator[tuple[tuple[str, int], Callable[[str], dict[str, Any]]]]:
    import boto3
    from botocore.config import Config

    p, endpoint = servers.start_moto()
    try:
        port = int(endpoint.rsplit(":", 1)[1])
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1", config=Config(s3={"addressing_style": "path"})
        ).create_bucket(Bucket=bucket)
        yield (
            ("127.0.0.1", port),
            lambda hp: {
                "name": "s3",
                "bucket": bucket,
                "endpoint_url": f"http://{hp}",
                "addressing_style": "path",
                "read_timeout_s": 60,
                "check_exists_before_put": False,
            },
        )
    finally:
        servers.stop_moto(p)


@contextmanager
def mooncake_service(tmp: Path) -> Iterator[tuple[None, Callable[[str], dict[str, Any]]]]:
    from lmcache_backend_mooncake.local import LocalMaster, LocalSegmentOwner

    master = LocalMaster(tmp)
    owner = LocalSegmentOwner(master, size_mib=1024)
    try:
        yield None, lambda _: master.section(key_prefix="bench/", staging_size=256 << 20, timeout_s=60.0)
    finally:
        owner.kill()
        master.kill()


SERVICES = {"redis": redis_service, "peer": peer_service, "s3": s3_service, "mooncake": mooncake_service}


def delayed(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    def call(*a: Any, **kw: Any) -> Any:
        time.sleep(seconds)
        return fn(*a, **kw)

    return call


def median_runs(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per function, run alternately (order rotating) so drift hits all."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiers", nargs="+", default=list(SERVICES), choices=list(SERVICES))
    p.add_argument("--rtt", type=float, nargs="+", default=[0, 1, 20])
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-kib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--window-mib", type=float, default=WINDOW_BYTES / 2**20, help="the latency proxy's bytes in flight per direction"
    )
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.chunk_kib = 3, 256
    shape = (a.chunk_kib * 1024 // 2,)
    n = a.chunks
    nbytes = n * a.chunk_kib * 1024
    ns = KeyNamespace(model="bench-remote-loads")
    print(
        f"bench_remote_loads: {n} chunks x {a.chunk_kib} KiB ({nbytes / 2**20:.0f} MiB) per load, median of {a.rounds} "
        f"alternating runs; {os.cpu_count()} CPUs shared by client and servers; latency proxy window "
        f"{a.window_mib:g} MiB per direction"
    )
    print(
        f"{'tier':10} {'RTT ms':>6} {'raw ms':>8} {'engine ms':>9} {'per-chunk ms':>12} {'engine RTTs':>11} "
        f"{'bound ms':>8} {'verdict':>7} {'engine/raw':>10}"
    )
    worst_ratio = 0.0
    misses = 0
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmpdir:
        for tier_name in a.tiers:
            tmp = Path(tmpdir) / tier_name
            tmp.mkdir()
            with SERVICES[tier_name](tmp) as (target, section_for):
                throughput: float | None = None
                for rtt in sorted(a.rtt):
                    with ExitStack() as stack:
                        if target is not None:
                            window = int(a.window_mib * 2**20)
                            proxy = stack.enter_context(LatencyProxy(target, rtt, window=window))
                            hp = proxy.url_host_port
                        else:
                            hp = ""
                        loaded = load_config(
                            env={}, overrides={"chunk_size": 256, "backends": [section_for(hp)], "staging_size": "512MiB"}
                        )
                        eng = stack.enter_context(CacheEngine(loaded, namespace=ns))
                        tier = eng.tiers[0]
                        simulated = target is None
                        if simulated and rtt:
                            tier.get_many = delayed(tier.get_many, rtt / 1000)  # type: ignore[method-assign]
                            tier.get = delayed(tier.get, rtt / 1000)  # type: ignore[method-assign]
                        hashes = [os.urandom(16) for _ in range(n)]
                        keys = eng.keys(hashes)
                        data = [torch.randn(shape).to(torch.float16) for _ in range(n)]
                        assert all(tier.put_many(list(zip(keys, data)))), "could not store the chunks"
                        outs = [torch.empty(shape, dtype=torch.float16) for _ in range(n)]

                        def raw() -> None:
                            assert all(tier.get_many(keys, outs))

                        def engine_path() -> None:
                            got = 0
                            for buf in eng.iter_chunks(hashes, [shape] * n, torch.float16):
                                got += 1
                                buf.release()
                            assert got == n, f"engine path loaded {got} of {n}"

                        def per_chunk() -> None:
                            for k, o in zip(keys, outs):
                                assert tier.get(k, o)

                        fns: dict[str, Callable[[], None]] = {"raw": raw, "engine": engine_path}
                        if rtt <= 1 or n <= 64:
                            fns["per_chunk"] = per_chunk
                        engine_path()  # warm connections
                        t = median_runs(fns, a.rounds)
                        raw()
                        assert all(torch.equal(o, d) for o, d in zip(outs, data)), "wrong bytes"
                        if throughput is None:
                            throughput = nbytes / t["raw"]
                        bound = 1.1 * (3 * rtt / 1000 + nbytes / throughput)
                        ok = t["engine"] <= bound
                        misses += not ok
                        ratio = t["engine"] / t["raw"]
                        worst_ratio = max(worst_ratio, ratio)
                        label = tier_name + ("*" if simulated else "")
                        print(
                            f"{label:10} {rtt:6.0f} {t['raw'] * 1e3:8.1f} {t['engine'] * 1e3:9.1f} "
                            f"{t.get('per_chunk', float('nan')) * 1e3:12.1f} "
                            f"{(t['engine'] / (rtt / 1000)) if rtt else float('nan'):11.1f} {bound * 1e3:8.1f} "
                            f"{'PASS' if ok else 'MISS':>7} {ratio:10.2f}",
                            flush=True,
                        )
    print(
        f"\n* simulated: each tier call delayed by one RTT (Mooncake's transfer engine opens its own connections). "
        f"Bound: 3 RTT + bytes / the raw batch throughput at the lowest RTT, +10%. "
        f"engine/raw worst {worst_ratio:.2f} ({'PASS' if worst_ratio <= 1.2 else 'MISS'}: <= 1.2); bound misses: {misses}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
