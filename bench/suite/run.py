"""Benchmark suite: lmcache-core against the alternatives, on real vLLM (CPU).

    python bench/suite/run.py [--quick] [--out bench/results/<name>] [--repeats N]

Workloads (token-id prompts on a locally built model; random weights, so prefill cost
and KV shapes are real while the text is noise):

- ``docqa``: long-document QA. Documents of 2k-8k tokens (``--quick``: 1k-2k), each
  asked several different questions; the queries go round-robin over the documents
  (every document once, then every document again, ...), so a cache must hold all of
  them to hit.
- ``chat``: multi-round chat. Several users share a system prompt; each round's prompt
  is the previous prompt + the previous answer + a new user turn. Answers are
  synthetic token ids of fixed length (TTFT is measured with ``max_tokens=1``).

Systems, each on a fresh engine per workload, one request at a time:

- ``recompute``: vLLM, no connector, prefix caching off;
- ``vllm-prefix-cache``: vLLM's in-engine prefix cache, no connector;
- ``example-connector``: vLLM's ExampleConnector (safetensors files), prefix caching off;
- ``lmc-cpu``: lmcache-core, CPU tier;
- ``lmc-disk`` / ``lmc-s3`` / ``lmc-peer`` / ``lmc-redis`` / ``lmc-mooncake``: lmcache-core with a small CPU tier in front
  of a disk tier, an S3 tier (moto on loopback, separate process) or a peer cache node
  (``lmcache-peer-serve``, separate process) or a ``redis-server`` on loopback (its own
  process, no persistence) or a Mooncake Store (``mooncake_master`` and a 2 GiB segment
  owner from the client wheel, on loopback), so repeat hits are read from that tier.

Connector systems run with vLLM's prefix caching off, so every hit counted comes from
the connector. TTFT = wall time of ``LLM.generate`` with ``max_tokens=1``. Between
requests (outside the timed region) the suite waits for lmcache-core's background
writes to slower tiers, so each request sees a tier that has caught up.

Then a cache-size sweep: the doc QA and chat workloads with the CPU tier at
25/50/100/200% of each working set's KV bytes, for each eviction policy in
``--sweep-policies`` side by side (CPU tier only), and doc QA with a disk tier behind
a CPU tier of the default policy. The benchmark prints issue #16's bars (PASS/FAIL with
the percentages): at 50% the scan-resistant policy serves >= 40% of the warm doc-QA
tokens, and never fewer chat tokens than LRU. ``--sweep-only`` runs just the sweep.

Outputs in ``--out``: ``results.md`` (tables + machine), ``results.json`` (raw
per-request numbers), ``ttft_vs_context.png``, ``hit_rate_vs_cache_size.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import report  # noqa: E402 - from HERE, put on sys.path above
from lib import servers  # noqa: E402 - from bench/, put on sys.path above

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHUNK = 256

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIABENCHLMCACHE0001",
    "AWS_SECRET_ACCESS_KEY": "bench-only-dummy-secret-not-a-real-key",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}

# ---------------------------------------------------------------------------- workloads


@dataclass
class Request:
    tokens: list[int]
    warm: bool
    group: int


@dataclass
class Workload:
    name: str
    title: str
    requests: list[Request] = field(default_factory=list)

    @property
    def max_len(self) -> int:
        return max(len(r.tokens) for r in self.requests)


def docqa(doc_lengths: list[int], queries: int, vocab: int, question_tokens: int = 32) -> Workload:
    from lmcache_connector.dev.tiny_model import random_prompt

    docs = [random_prompt(n, 10_000 + i, vocab) for i, n in enumerate(doc_lengths)]
    w = Workload("docqa", f"long-document QA ({len(docs)} docs, {queries} questions each)")
    for q in range(queries):
        for d, doc in enumerate(docs):
            question = random_prompt(question_tokens, 20_000 + 97 * d + q, vocab)
            w.requests.append(Request(doc + question, warm=q > 0, group=d))
    return w


def chat(users: int, rounds: int, vocab: int, system_tokens: int, turn_tokens: int, answer_tokens: int) -> Workload:
    from lmcache_connector.dev.tiny_model import random_prompt

    system = random_prompt(system_tokens, 30_000, vocab)
    w = Workload("chat", f"multi-round chat ({users} users, {rounds} rounds)")
    history = [list(system) for _ in range(users)]
    for r in range(rounds):
        for u in range(users):
            if r > 0:
                history[u] += random_prompt(answer_tokens, 40_000 + 1000 * u + r, vocab)  # previous answer
            history[u] += random_prompt(turn_tokens, 50_000 + 1000 * u + r, vocab)  # new user turn
            w.requests.append(Request(list(history[u]), warm=r > 0, group=r))
    return w


# ---------------------------------------------------------------------------- services


class MotoProcess:
    """moto's S3 server in a child process on 127.0.0.1 (not in this process: its
    request handling would compete with vLLM for this process's GIL)."""

    def __init__(self) -> None:
        os.environ.update(AWS_ENV)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            os.environ.pop(k, None)
        self.proc, self.endpoint = servers.start_moto()

    def make_bucket(self) -> str:
        import boto3
        from botocore.config import Config

        name = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", config=Config(s3={"addressing_style": "path"})
        ).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        servers.stop_moto(self.proc, timeout=10)


class PeerNode:
    """A standalone cache node (``lmcache-peer-serve``) on 127.0.0.1."""

    def __init__(self, secret: str) -> None:
        self.proc, self.address = servers.start_peer_serve("4GiB", env=dict(os.environ, LMCACHE_PEER_SECRET=secret))

    def stop(self) -> None:
        servers.stop(self.proc)


class RedisProcess:
    """A ``redis-server`` on 127.0.0.1 at a free port, no persistence, its own temp dir."""

    def __init__(self, root: Path) -> None:
        self.proc, self.port = servers.start_redis(tempfile.mkdtemp(prefix="redis-", dir=root))

    def stop(self) -> None:
        servers.stop(self.proc)


class MooncakeStore:
    """``mooncake_master`` plus one 2 GiB segment owner on 127.0.0.1, from the client wheel."""

    def __init__(self, root: Path) -> None:
        from lmcache_backend_mooncake.local import LocalMaster, LocalSegmentOwner

        os.environ.setdefault("GLOG_minloglevel", "2")
        self.master = LocalMaster(Path(tempfile.mkdtemp(prefix="mooncake-", dir=root)))
        self.owner = LocalSegmentOwner(self.master, size_mib=2048)

    def stop(self) -> None:
        self.owner.kill()
        self.master.kill()


# ---------------------------------------------------------------------------- systems


@dataclass
class System:
    name: str
    kind: str  # none | example | lmc
    prefix_caching: bool = False
    make_tiers: Callable[[Services], list[dict[str, Any]]] | None = None


class Services:
    """Fresh storage per engine: temp dirs, buckets, peer nodes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.moto: MotoProcess | None = None
        self.peer: PeerNode | None = None
        self.redis: RedisProcess | None = None
        self.mooncake: MooncakeStore | None = None
        self.secret = secrets.token_hex(16)
        # CPU tier in front of disk/s3/peer: the largest prompt's KV plus two chunks
        # (a load stages all of a request's chunks in the pool at once, so a smaller tier
        # would cap hits), far below the working set, so repeat hits come from the slower tier
        self.small_cpu = 0

    def tmpdir(self, prefix: str) -> str:
        return tempfile.mkdtemp(prefix=prefix, dir=self.root)

    def s3_section(self) -> dict[str, Any]:
        if self.moto is None:
            self.moto = MotoProcess()
        return {
            "name": "s3",
            "bucket": self.moto.make_bucket(),
            "endpoint_url": self.moto.endpoint,
            "addressing_style": "path",
            "region": "us-east-1",
        }

    def peer_section(self) -> dict[str, Any]:
        if self.peer is not None:  # a fresh node (empty cache) per engine
            self.peer.stop()
        self.peer = PeerNode(self.secret)
        return {"name": "peer", "peers": [self.peer.address], "secret": self.secret, "push": True, "max_size": 0}

    def redis_section(self) -> dict[str, Any]:
        if self.redis is None:
            self.redis = RedisProcess(self.root)
        # a fresh prefix per engine: an empty cache without restarting the server
        return {"name": "redis", "url": f"redis://127.0.0.1:{self.redis.port}/0", "prefix": f"bench-{uuid.uuid4().hex[:8]}:"}

    def mooncake_section(self) -> dict[str, Any]:
        if self.mooncake is None:
            self.mooncake = MooncakeStore(self.root)
        # a fresh key prefix per engine: an empty cache without restarting the store
        return self.mooncake.master.section(key_prefix=f"bench-{uuid.uuid4().hex[:8]}/")

    def close(self) -> None:
        for s in (self.peer, self.moto, self.redis, self.mooncake):
            if s is not None:
                s.stop()


SYSTEMS = [
    System("recompute", "none"),
    System("vllm-prefix-cache", "none", prefix_caching=True),
    System("example-connector", "example"),
    System("lmc-cpu", "lmc", make_tiers=lambda s: [{"name": "local_cpu", "max_size": "2GiB"}]),
    System(
        "lmc-disk",
        "lmc",
        make_tiers=lambda s: [{"name": "local_cpu", "max_size": s.small_cpu}, {"name": "disk", "path": s.tmpdir("disk-")}],
    ),
    System("lmc-s3", "lmc", make_tiers=lambda s: [{"name": "local_cpu", "max_size": s.small_cpu}, s.s3_section()]),
    System("lmc-peer", "lmc", make_tiers=lambda s: [{"name": "local_cpu", "max_size": s.small_cpu}, s.peer_section()]),
    System("lmc-redis", "lmc", make_tiers=lambda s: [{"name": "local_cpu", "max_size": s.small_cpu}, s.redis_section()]),
    System("lmc-mooncake", "lmc", make_tiers=lambda s: [{"name": "local_cpu", "max_size": s.small_cpu}, s.mooncake_section()]),
]


# ---------------------------------------------------------------------------- engine runs


@dataclass
class Setup:
    model: Path
    max_len: int
    kv_cache_bytes: int


def make_llm(setup: Setup, system: System, tiers: list[dict[str, Any]] | None, services: Services) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from lmcache_connector.transfer_config import kv_transfer_config

    kw: dict[str, Any] = {
        "model": str(setup.model),
        "dtype": "float32",  # this CPU has no bf16 support: fp32 prefill is ~10x faster here
        "enforce_eager": True,
        "max_model_len": setup.max_len,
        "max_num_batched_tokens": setup.max_len,  # whole prompt in one step (ExampleConnector needs it)
        "kv_cache_memory_bytes": setup.kv_cache_bytes,
        "enable_prefix_caching": system.prefix_caching,
        "seed": 0,
    }
    if system.kind == "example":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": services.tmpdir("example-")},
        )
    elif system.kind == "lmc":
        kw["kv_transfer_config"] = kv_transfer_config(
            {"backends": tiers, "chunk_size": CHUNK}, kv_connector_module_path="lmcache_connector"
        )
    return LLM(**kw)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def lmc_worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def run_workload(
    setup: Setup, system: System, workload: Workload, services: Services, bar: Any, tiers: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if system.kind == "lmc" and tiers is None:
        tiers = system.make_tiers(services)
    llm = make_llm(setup, system, tiers, services)
    try:
        sp = SamplingParams(max_tokens=1, temperature=0)
        # warm-up (not timed, not cached by anything later: its tokens are unrelated)
        from lmcache_connector.dev.tiny_model import random_prompt

        llm.generate([TokensPrompt(prompt_token_ids=random_prompt(300, 7, 64))], sp, use_tqdm=False)
        worker = lmc_worker() if system.kind == "lmc" else None
        if worker is not None:
            worker.engine.flush(timeout=30)
        base_tiers = _tier_stats(worker)
        reqs = []
        total = 0.0
        for req in workload.requests:
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=req.tokens)], sp, use_tqdm=False)
            dt = time.perf_counter() - t
            total += dt
            reqs.append(
                {
                    "prompt_tokens": len(req.tokens),
                    "cached_tokens": int(out[0].num_cached_tokens or 0),
                    "ttft_s": dt,
                    "warm": req.warm,
                    "group": req.group,
                }
            )
            if worker is not None:
                worker.engine.flush(timeout=60)  # background writes to slower tiers, not timed
            bar.update(1)
        tiers_out = _tier_delta(base_tiers, _tier_stats(worker))
        extra = {}
        if worker is not None:
            st = worker.stats()
            extra = {"loaded_tokens": st["loaded_tokens"], "saved_tokens": st["saved_tokens"], "failed_loads": st["failed_loads"]}
            extra["bytes_used"] = {t["name"]: t["bytes_used"] for t in st["engine"]["tiers"]}
        return {"system": system.name, "workload": workload.name, "requests": reqs, "total_s": total, "tiers": tiers_out, **extra}
    finally:
        shutdown(llm)


def _tier_stats(worker: Any) -> list[dict[str, Any]]:
    if worker is None:
        return []
    return [
        {k: t.get(k, 0) for k in ("name", "put_bytes", "get_bytes", "evictions", "hits", "misses", "errors", "skipped")}
        for t in worker.stats()["engine"]["tiers"]
    ]


def _tier_delta(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for b, a in zip(before, after):
        out.append({k: (a[k] - b[k] if k != "name" else a[k]) for k in a})
    return out


# ---------------------------------------------------------------------------- machine


def machine_info() -> dict[str, str]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    import torch
    import vllm

    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "memory": mem,
        "load_average_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------------- main


def plan(quick: bool, vocab: int) -> tuple[list[Workload], Workload, list[float]]:
    if quick:
        docs = docqa([1024, 1365, 1707, 2048], queries=3, vocab=vocab)
        conv = chat(users=3, rounds=4, vocab=vocab, system_tokens=256, turn_tokens=64, answer_tokens=96)
        sweep = docqa([1024, 1365, 1707, 2048], queries=2, vocab=vocab)
    else:
        docs = docqa([2048, 3277, 4506, 5734, 6963, 8192], queries=3, vocab=vocab)
        conv = chat(users=4, rounds=6, vocab=vocab, system_tokens=512, turn_tokens=96, answer_tokens=160)
        sweep = docqa([2048, 3277, 4506, 5734, 6963, 8192], queries=2, vocab=vocab)
    return [docs, conv], sweep, [0.25, 0.5, 1.0, 2.0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k-2k token documents, fewer requests (a few minutes)")
    ap.add_argument(
        "--out", type=Path, default=None, help="results folder (default bench/results/<quick|full>-<time>, which git ignores)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="runs per system and workload, order rotated; medians per request (default 1)"
    )
    ap.add_argument("--systems", default=",".join(s.name for s in SYSTEMS), help="comma-separated subset of systems")
    ap.add_argument("--no-sweep", action="store_true", help="skip the cache-size sweep")
    ap.add_argument("--sweep-only", action="store_true", help="only the cache-size sweep (no system comparison)")
    ap.add_argument("--sweep-policies", default="lru,s3fifo,tinylfu", help="eviction policies compared in the sweep")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to build the model (default ~/.cache/lmcache-core/<tag>)")
    args = ap.parse_args(argv)

    from lmcache_connector.dev.tiny_model import TinyModelSpec, build_tiny_model
    from tqdm import tqdm

    spec = TinyModelSpec(
        hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096
    )
    repeats = args.repeats or 1
    out = args.out or HERE.parent / "results" / f"{'quick' if args.quick else 'full'}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(wanted) - {s.name for s in SYSTEMS}
    if unknown:
        ap.error(f"unknown systems: {', '.join(sorted(unknown))}")
    systems = [s for s in SYSTEMS if s.name in wanted]
    t_start = time.perf_counter()
    model_dir = args.model_dir or Path.home() / ".cache" / "lmcache-core" / spec.tag()
    print(f"building/reusing the local model {spec.tag()} in {model_dir}", flush=True)
    build_tiny_model(model_dir, spec)
    workloads, sweep_wl, fractions = plan(args.quick, spec.vocab_size)
    max_len = -(-max(w.max_len for w in [*workloads, sweep_wl]) // 256) * 256 + 256
    setup = Setup(model_dir, max_len, kv_cache_bytes=1 << 30)
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # float32
    machine = machine_info()
    command = (
        "python bench/suite/run.py"
        + (" --quick" if args.quick else "")
        + (" --sweep-only" if args.sweep_only else "")
        + (f" --sweep-policies {args.sweep_policies}" if args.sweep_only else "")
        + f" --out {out}"
        + (f" --repeats {args.repeats}" if args.repeats else "")
    )

    root = Path(tempfile.mkdtemp(prefix="lmc-bench-"))
    services = Services(root)
    max_prompt = max(w.max_len for w in workloads)
    services.small_cpu = (max_prompt // CHUNK + 2) * CHUNK * kv_bytes_per_token
    print(f"warming up (one engine, not timed); small CPU tier = {report.fmt_bytes(services.small_cpu)}", flush=True)
    run_workload(setup, SYSTEMS[0], Workload("warmup", "", [Request(list(range(3, 1000)), False, 0)]), services, _NullBar())
    n_main = repeats * len(systems) * sum(len(w.requests) for w in workloads)
    do_sweep = not args.no_sweep and (args.sweep_only or any(s.name == "lmc-cpu" for s in systems))
    policies = [p.strip() for p in args.sweep_policies.split(",") if p.strip()]
    sweep_wls = [sweep_wl, workloads[1]]  # round-robin doc QA, multi-round chat
    if args.sweep_only:
        n_main = 0
    n_sweep = (
        len(fractions) * (len(policies) * sum(len(w.requests) for w in sweep_wls) + len(sweep_wl.requests)) if do_sweep else 0
    )
    raw: dict[tuple[str, str], list[dict[str, Any]]] = {}
    sweep_points: list[dict[str, Any]] = []
    unlimited_hit = None
    try:
        with tqdm(total=n_main + n_sweep, desc="requests", unit="req", file=sys.stdout, dynamic_ncols=True) as bar:
            for rep in range(0 if args.sweep_only else repeats):
                order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
                for w in workloads:
                    for s in order:
                        bar.set_postfix_str(f"{s.name} / {w.name} (repeat {rep + 1}/{repeats})")
                        raw.setdefault((s.name, w.name), []).append(run_workload(setup, s, w, services, bar))
            runs = [_median_run(raw[(s.name, w.name)]) for w in workloads for s in systems if (s.name, w.name) in raw]
            if do_sweep:
                cpu_sys = next(s for s in SYSTEMS if s.name == "lmc-cpu")
                from lmcache_core.local_cpu import DEFAULT_EVICTION

                for wl in sweep_wls:
                    # working set: what an unlimited CPU tier holds after the workload
                    bar.set_postfix_str(f"sweep: measuring the working set of {wl.name}")
                    ref = run_workload(setup, cpu_sys, wl, services, _NullBar())
                    ws = ref["bytes_used"]["local_cpu"]
                    if wl is sweep_wl:
                        unlimited_hit = report.summarize(ref)["hit_rate"]
                    combos = [(False, p) for p in policies] + ([(True, DEFAULT_EVICTION)] if wl is sweep_wl else [])
                    for disk, policy in combos:
                        for f in fractions:
                            size = max(int(ws * f), 1 << 20)
                            tiers = [{"name": "local_cpu", "max_size": size, "eviction": policy}]
                            if disk:
                                tiers.append({"name": "disk", "path": services.tmpdir("sweep-disk-")})
                            bar.set_postfix_str(f"sweep: {wl.name}, CPU tier {f * 100:.0f}% {policy}{' + disk' if disk else ''}")
                            r = run_workload(setup, cpu_sys, wl, services, bar, tiers=tiers)
                            s = report.summarize(r)
                            sweep_points.append(
                                {
                                    "workload": wl.name,
                                    "policy": policy,
                                    "disk": disk,
                                    "fraction": f,
                                    "cpu_bytes": size,
                                    "working_set_bytes": ws,
                                    "hit_rate": s["hit_rate"],
                                    "warm_hit_rate": s["warm_hit_rate"],
                                    "ttft_mean_s": s["mean"],
                                    "warm_ttft_mean_s": s["warm_mean"],
                                    "tiers": r["tiers"],
                                }
                            )
    finally:
        services.close()
        shutil.rmtree(root, ignore_errors=True)

    elapsed = time.perf_counter() - t_start
    machine["load_average_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    titles = {w.name: w.title for w in workloads}
    if runs:
        report.plot_ttft_vs_context(runs, out / "ttft_vs_context.png", titles)
    if sweep_points:
        report.plot_sweep(sweep_points, out / "hit_rate_vs_cache_size.png", unlimited_hit)
    md = render(runs, workloads, sweep_points, sweep_wl, machine, command, repeats, elapsed, spec, setup, services.small_cpu)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "command": command,
                "repeats": repeats,
                "elapsed_s": elapsed,
                "titles": titles,
                "unlimited_hit_rate": unlimited_hit,
                "runs": runs,
                "sweep": sweep_points,
            },
            indent=1,
        )
    )
    print()
    print(md)
    print(f"results in {out} ({elapsed:.0f} s)")
    return 0


class _NullBar:
    def update(self, n: int) -> None:
        pass


def _median_run(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-request median TTFT over repeats (the same requests in the same order)."""
    import statistics

    if len(reps) == 1:
        return reps[0]
    first = reps[0]
    reqs = []
    for i, r in enumerate(first["requests"]):
        reqs.append(
            dict(
                r,
                ttft_s=statistics.median(rep["requests"][i]["ttft_s"] for rep in reps),
                cached_tokens=int(statistics.median(rep["requests"][i]["cached_tokens"] for rep in reps)),
            )
        )
    return dict(first, requests=reqs, total_s=statistics.median(rep["total_s"] for rep in reps))


def render(
    runs: list[dict[str, Any]],
    workloads: list[Workload],
    sweep: list[dict[str, Any]],
    sweep_wl: Workload,
    machine: dict[str, str],
    command: str,
    repeats: int,
    elapsed: float,
    spec: Any,
    setup: Setup,
    small_cpu: int,
) -> str:
    parts = ["# lmcache-core benchmark suite results", ""]
    parts.append(
        f"Command: `{command}` ({elapsed / 60:.1f} min, {repeats} repeat(s) per system and workload; per-request medians over repeats)."
    )
    parts.append("")
    parts.append(
        "Machine: "
        + ", ".join(f"{k} {v}" for k, v in machine.items())
        + f". Model: random-weight Llama {spec.tag()}, float32, vLLM CPU backend, eager, "
        f"vLLM KV cache {report.fmt_bytes(setup.kv_cache_bytes)} (holds the whole working set, so the in-engine "
        f"prefix cache is at its best here), lmcache-core chunk size {CHUNK}. lmc-cpu: CPU tier 2 GiB; "
        f"lmc-disk/s3/peer/redis/mooncake: CPU tier {report.fmt_bytes(small_cpu)} (largest prompt + 2 chunks) in front of the slower tier."
    )
    for w in workloads if runs else []:
        lens = [len(r.tokens) for r in w.requests]
        parts += ["", f"## {w.title}", "", f"{len(w.requests)} requests, prompts {min(lens)}-{max(lens)} tokens.", ""]
        parts.append(report.workload_tables(runs, w.name))
    if sweep:
        ws = {p.get("workload", "docqa"): p["working_set_bytes"] for p in sweep}
        parts += [
            "",
            "## Cache-size sweep (doc QA, chat; eviction policies side by side)",
            "",
            (
                f"doc QA: {len(sweep_wl.requests)} requests, working set {report.fmt_bytes(ws.get('docqa', 0))} of KV; "
                f"chat: working set {report.fmt_bytes(ws.get('chat', 0))} "
                "(what an unlimited CPU tier holds after the workload). Round-robin access: an LRU "
                "CPU tier smaller than the working set evicts each document before it comes back."
            ),
            "",
            report.sweep_table(sweep),
            "",
            "Bars (issue #16):",
            "",
            *[f"- {line}" for line in report.policy_bars(sweep, "tinylfu")],
        ]
    parts += [
        "",
        (
            "Hit rate: tokens served from a cache (`num_cached_tokens`) / prompt tokens, over all requests "
            "(first visits included, so 100% is not reachable). Warm: repeat requests only. "
            "Bytes are the lmcache-core tiers' counters during the workload."
        ),
        "",
        (
            "Notes: ExampleConnector keys a stored prompt by a hash of its block-aligned prefix (128-token "
            "blocks, last token excluded) and only hits when a new prompt has exactly that prefix: here a "
            "document followed by a question shorter than a block, and never a grown chat history. "
            "Timings on a shared, loaded machine are noisy: compare ratios, rerun with `--repeats`."
        ),
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
