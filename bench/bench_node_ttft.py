"""Several engines on one node: loads from a node-local ``lmcache-core serve`` node
through shared memory and over loopback TCP, against a plain memcpy and against the
engine's own CPU tier, side by side in one run.

One node (``--listen 127.0.0.1:0 --unix-socket PATH``, frames in its shared-memory
arena) serves every path below.

* chunk loads: a "prompt" of N chunks read the way the engine reads it, the peer
  tier's ``contains`` (the scheduler's lookup: one LOCATE / LOOKUP for the N keys)
  then ``get`` of each chunk into its own output tensor, through
  - shm: the Unix socket's shared memory (``unix_socket`` + ``shm: true``),
  - socket: the same Unix socket carrying the frames (``shm: false``),
  - TCP: loopback TCP (``peers: [127.0.0.1:PORT]``),
  against ``torch.Tensor.copy_`` of N chunks of the same size between tensors of
  their own (one thread, as the tier copies on one). Per chunk size: best and median
  over the repetitions, GB/s with and without the lookup, and shm / memcpy against
  the fast path's bar of 0.7 (PASS/MISS, on the median, lookup included);
* warm TTFT: engine A computes the prompts (own CPU tier, pushes to the node); fresh
  engines load them through the node's shared memory or over loopback TCP, each once
  with an empty CPU tier in front of the node (the deployed shape: what it loads is
  promoted into that tier) and once with the node only; one engine that keeps
  everything in its own CPU tier asks twice (cold: recompute + save, warm: its CPU
  tier). Every engine first
  runs one warm-up prompt of the same kind (A and the node engines: a prompt A
  pushed), so the medians compare load paths, not a process's one-time costs; the
  fresh engines' first load is printed apart.

    python bench/bench_node_ttft.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from lib.servers import start_cache_node  # noqa: E402
from lib.ttft_engine import finish, make_llm, run_child, run_if_child, tiny_model, ttft  # noqa: E402

BAR = 0.7
"""The same-host fast path's bar: a chunk's load at >= 0.7 of a plain memcpy's throughput."""

MiB = 1 << 20


def child(model: str, config: dict[str, Any], warmup: list[list[int]], prompts: list[list[int]], passes: int) -> None:
    """One vLLM process: TTFT of the warm-up prompts, then of each prompt per pass, as a JSON line."""
    from lmcache_connector.transfer_config import kv_transfer_config

    llm = make_llm(model, kv_transfer_config(config))
    first, _ = ttft(llm, warmup)
    out: list[dict[str, Any]] = []
    for _ in range(passes):
        times, cached = ttft(llm, prompts)
        out.append({"times": times, "cached": cached})
    finish(llm, {"warmup": first, "passes": out}, flush=True)


def run_engine(
    model: Path, config: dict[str, Any], warmup: list[list[int]], prompts: list[list[int]], passes: int, what: str
) -> dict[str, Any]:
    job = {"model": str(model), "config": config, "warmup": warmup, "prompts": prompts, "passes": passes}
    result: dict[str, Any] = run_child(__file__, job, what)
    return result


def start_node(tmp: Path, max_size: str) -> tuple[subprocess.Popen, str, str, Path]:
    """A node on loopback TCP and a Unix socket: (process, host:port, socket path, secret file)."""
    node = start_cache_node(tmp, max_size, unix_socket=True)
    assert node.unix_socket is not None
    return node.proc, node.address, node.unix_socket, node.secret_file


def peer_section(secret: Path, *, tcp: str | None = None, sock: str | None = None, shm: bool = True) -> dict[str, Any]:
    """The engine's peer tier for the node: over TCP, or on its Unix socket (with or without shm)."""
    section: dict[str, Any] = {"name": "peer", "secret_file": str(secret), "max_size": 0, "timeout_s": 30.0}
    if tcp is not None:
        section["peers"] = [tcp]
    else:
        section.update(unix_socket=sock, shm=shm)
    return section


def chunk_loads(
    tcp: str, sock: str, secret: Path, sizes: list[int], n_chunks: dict[int, int], rounds: int
) -> list[dict[str, Any]]:
    """Per chunk size, per path: lists of (lookup seconds, load seconds) of one N-chunk
    prompt, repetitions interleaved across the paths, each path first in turn (load on the machine
    hits all alike)."""
    import torch

    from lmcache_backend_peer import PeerClient, create_peer_backend
    from lmcache_backend_peer.backend import PeerBackend
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.serde import RawCodec, encode
    from lmcache_core.testing import make_context

    torch.set_num_threads(1)  # a plain memcpy is one thread (and the peer tier copies on one)
    host, port = tcp.rsplit(":", 1)
    pusher = PeerClient((host, int(port)), secret.read_text().encode(), timeout=60)
    backends: dict[str, PeerBackend] = {}
    for path, section in (
        ("shm", peer_section(secret, sock=sock)),
        ("socket", peer_section(secret, sock=sock, shm=False)),
        ("tcp", peer_section(secret, tcp=tcp)),
    ):
        backend = create_peer_backend({k: v for k, v in section.items() if k != "name"}, make_context(pool_bytes=MiB))
        assert isinstance(backend, PeerBackend)
        backends[path] = backend
    results = []
    try:
        for size in sizes:
            n = n_chunks[size]
            ns = KeyNamespace(model=f"bench-node-{size}")
            keys = [ns.key(os.urandom(16)) for _ in range(n)]
            srcs = [torch.randn(size // 4) for _ in range(n)]
            for k, s in zip(keys, srcs):
                if not pusher.put(k, encode(k, s, RawCodec())):
                    raise SystemExit("the node refused a chunk")
            dsts = [torch.zeros_like(s) for s in srcs]  # pages touched before timing
            outs = {path: [torch.zeros_like(s) for s in srcs] for path in backends}
            times: dict[str, list[tuple[float, float]]] = {p: [] for p in ("memcpy", *backends)}
            hits_before = backends["shm"].stats().extra.get("shm_hits", 0)
            order = ["memcpy", *backends]
            for r in range(rounds + 1):  # round 0 warms connections, mappings and caches; not counted
                for path in order[r % len(order) :] + order[: r % len(order)]:  # each path first in turn
                    t0 = time.perf_counter()
                    if path == "memcpy":
                        for s, d in zip(srcs, dsts):
                            d.copy_(s)
                        found, ok, t1 = n, True, t0
                    else:
                        found = backends[path].contains(keys)
                        t1 = time.perf_counter()
                        ok = all(backends[path].get(k, o) for k, o in zip(keys, outs[path]))
                    t2 = time.perf_counter()
                    if found != n or not ok:
                        raise SystemExit(f"{path}: the node missed ({found}/{n} found)")
                    if r:
                        times[path].append((t1 - t0, t2 - t1))
            for path, o in outs.items():
                if not all(torch.equal(a, b) for a, b in zip(o, srcs)):
                    raise SystemExit(f"{path}: wrong bytes loaded")
            shm_hits = backends["shm"].stats().extra.get("shm_hits", 0) - hits_before
            if shm_hits < n * rounds:  # a negative control: the shm path did not fall back to its socket
                raise SystemExit(f"the shm path served {shm_hits} of {n * rounds} chunks from shared memory")
            results.append({"size": size, "n": n, "times": times})
            pusher.remove(keys)
    finally:
        pusher.close()
        for backend in backends.values():
            backend.close()
    return results


def _verdict(ratio: float) -> str:
    return "PASS" if ratio >= BAR else "MISS"


def report_chunks(results: list[dict[str, Any]]) -> list[str]:
    """Print the chunk-load table; the bar's verdict per chunk size, one line each."""
    labels = {
        "memcpy": "memcpy (torch copy_, 1 thread)",
        "shm": "node, shared memory",
        "socket": "node, Unix socket (shm: false)",
        "tcp": "node, loopback TCP",
    }
    verdicts = []
    print(
        f"\n{'chunk load':<34}{'load GB/s':>16}{'lookup+load GB/s':>20}{'lookup us':>11}{'vs memcpy':>11}\n"
        f"{'':<34}{'best / median':>16}{'best / median':>20}{'median':>11}{'median':>11}"
    )
    for res in results:
        size, n = res["size"], res["n"]
        print(f"-- chunks of {size / MiB:g} MiB, a prompt of {n} (lookup once, then {n} loads)")
        nbytes = size * n
        load: dict[str, tuple[float, float]] = {}  # path: (best, median) seconds
        total: dict[str, tuple[float, float]] = {}
        for path, label in labels.items():
            rows = res["times"][path]
            loads, totals = [b for _, b in rows], [a + b for a, b in rows]
            load[path] = (min(loads), statistics.median(loads))
            total[path] = (min(totals), statistics.median(totals))
            gbs = " / ".join(f"{nbytes / t / 1e9:.2f}" for t in load[path])
            gbs_all = " / ".join(f"{nbytes / t / 1e9:.2f}" for t in total[path])
            lookup = statistics.median(a for a, _ in rows) * 1e6
            print(f"{label:<34}{gbs:>16}{gbs_all:>20}{lookup:>11.0f}{total['memcpy'][1] / total[path][1]:>11.2f}")
        for what, t in (("load", load), ("lookup + load", total)):
            best, med = (t["memcpy"][i] / t["shm"][i] for i in (0, 1))
            print(f"shm / memcpy, {what}: best {best:.2f}, median {med:.2f} (bar {BAR}, on the median) -> {_verdict(med)}")
        print(f"shm / TCP, lookup + load: {total['tcp'][1] / total['shm'][1]:.1f}x faster (median)")
        ld, tt = (t["memcpy"][1] / t["shm"][1] for t in (load, total))
        verdicts.append(f"{size / MiB:g} MiB: load {ld:.2f} {_verdict(ld)}, lookup + load {tt:.2f} {_verdict(tt)}")
    return verdicts


def main() -> int:
    if run_if_child(child):
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts x 2048 tokens, 20 rounds of chunk loads")
    args = ap.parse_args()
    from lmcache_connector.dev.tiny_model import random_prompt

    spec, model = tiny_model()
    n, tokens, rounds = (2, 2048, 20) if args.quick else (8, 4096, 50)
    prompts = [random_prompt(tokens, 900 + i, spec.vocab_size) for i in range(n)]
    warm = random_prompt(tokens, 899, spec.vocab_size)  # each engine's first (untimed in the medians)
    chunk_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 256 * 4
    sizes = [chunk_bytes, 16 * MiB]  # this model's chunk; a 16 MiB one (e.g. 256 tokens of an 8B model's KV in fp8)
    n_chunks = {chunk_bytes: tokens // 256, 16 * MiB: 4}
    tmp = Path(tempfile.mkdtemp(prefix="lmcache-node-ttft-"))
    node, tcp, sock, secret = start_node(tmp, "2GiB")
    print(f"model {spec.tag()} (float32), {n} prompts x {tokens} tokens, chunk {chunk_bytes >> 10} KiB; node {tcp} and {sock}")
    print(f"load average {open('/proc/loadavg').read().split()[:3]}", flush=True)
    try:
        verdicts = report_chunks(chunk_loads(tcp, sock, secret, sizes, n_chunks, rounds))
        cpu = {"name": "local_cpu", "max_size": "1GiB"}
        print("\nengines: own CPU tier (warm-up prompt twice, then the prompts twice) ...", flush=True)
        own = run_engine(model, {"backends": [cpu]}, [warm, warm], prompts, 2, "own CPU tier")
        print("engines: A computes the warm-up prompt and the prompts, pushes them to the node ...", flush=True)
        pushing = {"backends": [cpu, {**peer_section(secret, sock=sock), "push": True}]}
        run_engine(model, pushing, [warm], prompts, 1, "engine A")
        fresh: dict[str, dict[str, Any]] = {}
        for via, section in (("shared memory", peer_section(secret, sock=sock)), ("loopback TCP", peer_section(secret, tcp=tcp))):
            for tiers, backends in (("CPU tier + node", [cpu, section]), ("node only", [section])):
                label = f"{tiers}, via {via}"
                print(f"engines: fresh engine, {label} (warm-up prompt, then the prompts) ...", flush=True)
                fresh[label] = run_engine(model, {"backends": backends}, [warm], prompts, 1, label)
    finally:
        node.kill()
        node.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    cold, warm_own = own["passes"]
    rows = [("cold (recompute + save)", cold), ("warm, own CPU tier", warm_own)]
    rows += [(f"fresh, {label}", r["passes"][0]) for label, r in fresh.items()]
    med = {label: statistics.median(r["times"]) for label, r in rows}
    base = med["warm, own CPU tier"]
    print(f"\n{'TTFT (after a warm-up prompt)':<42}{'ms (median)':>13}{'vs own CPU':>12}{'cached tok':>12}{'first load ms':>15}")
    firsts = {f"fresh, {label}": r["warmup"][0] for label, r in fresh.items()} | {"warm, own CPU tier": own["warmup"][1]}
    for label, r in rows:
        first = f"{firsts[label] * 1000:.1f}" if label in firsts else ""
        cached = int(statistics.median(r["cached"]))
        print(f"{label:<42}{med[label] * 1000:>13.1f}{med[label] / base:>12.2f}{cached:>12}{first:>15}")
    for tiers in ("CPU tier + node", "node only"):
        shm_t, tcp_t = med[f"fresh, {tiers}, via shared memory"], med[f"fresh, {tiers}, via loopback TCP"]
        print(
            f"{tiers}: shm / own CPU tier {shm_t / base:.2f}x, TCP / own CPU tier {tcp_t / base:.2f}x, TCP / shm {tcp_t / shm_t:.2f}x"
        )
    print(
        "(first load ms: the warm-up prompt's TTFT, not in the medians; a fresh engine with a CPU tier promotes each\n"
        " loaded chunk into it, i.e. into pool pages touched for the first time: the gap to 'node only')"
    )
    print(f"load average {open('/proc/loadavg').read().split()[:3]}")
    print(f"bar: shm chunk load >= {BAR} of memcpy (medians): {'; '.join(verdicts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
