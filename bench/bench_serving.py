"""The OpenAI server as the unit under test: lmcache-core's benchmark of record.

    python bench/bench_serving.py [--quick] [--arms vllm lmc-cpu limit floor ...]
                                  [--concurrency 1 4 16] [--workloads docqa chat unique vllm-bench]
                                  [--repeat N] [--out bench/results/serving]

Each arm is a fresh ``python -m vllm.entrypoints.openai.api_server`` (API process,
engine-core process; vLLM's default multiprocessing) on 127.0.0.1 serving the same
locally built model (random weights, a byte-level BPE tokenizer trained on the spot, so
text clients work), every arm with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (see
docs/deployment.md). Arms, run in turn and, with ``--repeat``, in a rotating order:

- ``vllm``: vLLM alone, its prefix cache on, a small KV cache (``--small-kv``);
- ``lmc-cpu``: the same plus lmcache-core, CPU tier;
- ``lmc-cpu2``: ``lmc-cpu`` with the ``--variant KEY=VALUE`` settings (dotted keys, e.g.
  ``connector.async_saves=true background_cores=auto``), to compare settings in one run;
- ``lmc-disk``: a small CPU tier in front of a disk tier;
- ``lmc-node``: a node-local ``lmcache-core serve`` node loaded through shared memory;
- ``lmc-redis``: a small CPU tier in front of a ``redis-server`` on loopback;
- ``lmcache``: LMCache (multiprocess mode) instead of lmcache-core: its server with an
  L1 of ``--cpu-size``, vLLM (the same version) in LMCache's own environment, built on
  first use or with ``--setup-lmcache`` (``bench/lib/lmcache_arm.py``). With ``lmc-cpu``
  in the same run the report adds lmcache-core / LMCache ratios;
- ``limit``: vLLM alone with a KV cache that holds everything (nothing to load);
- ``floor``: the limit limited to as many running requests as the small cache holds
  (``--max-num-seqs``): the scheduling floor of the small cache.

Workloads (text prompts; temperature 0; streamed, so first-token and inter-token times
are the client's):

- ``docqa``: long-document QA, as LMCache's long-doc-QA client: ``--docs`` documents of
  ``--doc-tokens`` tokens, ``--questions`` questions each, asked round-robin (every
  document once, then every document again), at each ``--concurrency``; the KV volume
  is several times the small cache ("pressure").
- ``chat``: multi-turn chat: users sharing a system prompt, each turn the history plus
  the last answer plus a new message; ``--concurrency`` users at a time.
- ``unique``: no reuse: unique prompts at the highest concurrency.
- ``vllm-bench``: vLLM's own serving benchmark (``vllm.benchmarks.serve``, run through
  Python because ``vllm bench`` fails on the CPU build), ``prefix_repetition`` dataset.
- ``trace``: production traffic's sharing, scaled to this machine: the first
  ``--trace-requests`` requests of ``--trace`` (Mooncake format; default the
  conversation trace in ../shared/traces), in order, each prompt the text of its first
  ``--trace-max-blocks`` blocks, ``--trace-block-tokens`` tokens per block id (the same
  id, the same text: two prompts share exactly the blocks the trace says; keep it equal
  to ``--chunk-size``). With ``--cpu-size`` a share of the printed distinct KV,
  ``--arms lmc-cpu lmc-cpu-lru`` compares the default eviction policy with LRU as TTFT
  and loaded tokens, e.g. ``--workloads trace --concurrency 4 --chunk-size 128
  --cpu-size 340MiB``.

Printed per workload and concurrency: req/s, output tok/s, TTFT p50/p90/p99, ITL
p50/p99 (medians over rounds, and the ITL p99 pooled over every round's gaps: one
round's p99 is its few largest gaps), tokens vLLM's prefix cache hit, tokens
lmcache-core loaded, RSS of the server's processes, ratios to ``limit`` and ``floor`` (and to ``vllm`` for ``unique``),
and whether every arm's greedy outputs are identical. Outputs in ``--out``:
``results.json``, ``results.md``, ``ttft.png``, and each server's log
(``server-logs/round<N>-<arm>.log``; LMCache's server: ``round<N>-lmcache.lmcache-server.log``). Never part of the test pass.

Exit status 1 when a request failed or an arm gave no results; ``--quick`` (a 32 MiB small
cache, below its documents' KV, and no ``floor`` arm) also fails when ``lmc-cpu`` loaded
nothing on doc QA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from lib.openai_client import Texts, pct, run_chat, run_requests, summarize
from contextlib import contextmanager
from typing import Iterator

from lib import lmcache_arm
from lib.openai_server import KV_PER_TOKEN, Arm, build_model, cpu_seconds, http_get, log, metric, rss_mib, server

ROOT = Path(__file__).resolve().parents[1]
CPU_BLOCK = 128  # vLLM-CPU's KV block size (tokens)


def floor_seqs(kv_bytes: int, request_tokens: int) -> int:
    """How many requests of ``request_tokens`` (prompt + output) vLLM runs at once in a
    KV cache of ``kv_bytes``: whole blocks per request, and one block of the pool is
    vLLM's null block (85 blocks of 64 MiB hold 4 requests of 2,080 tokens, not 5)."""
    blocks = kv_bytes // (CPU_BLOCK * KV_PER_TOKEN)
    per_request = -(-request_tokens // CPU_BLOCK)
    return max(1, int((blocks - 1) // per_request))


# -- workloads ----------------------------------------------------------------------------
def docqa_prompts(texts: Texts, args: argparse.Namespace) -> list[tuple[str, int]]:
    docs = [texts.text(args.doc_tokens) for _ in range(args.docs)]
    questions = [[texts.text(12) + "?" for _ in range(args.questions)] for _ in docs]
    out = []
    for q in range(args.questions):  # round-robin: every document once, then again
        for d, doc in enumerate(docs):
            out.append((doc + "\nQuestion: " + questions[d][q] + "\nAnswer:", args.output_tokens))
    return out


def chat_users(texts: Texts, args: argparse.Namespace, n_users: int) -> tuple[str, list[list[str]]]:
    system = "System: " + texts.text(args.chat_system_tokens)
    users = [[texts.text(args.chat_message_tokens) for _ in range(args.chat_turns)] for _ in range(n_users)]
    return system, users


def trace_prompts(texts: Texts, args: argparse.Namespace) -> list[tuple[str, int]]:
    """The trace's first requests as prompts: one fixed text per block id."""
    from lmcache_core.traces import load_trace

    trace = load_trace(args.trace, limit=args.trace_requests)
    block_text: dict[int, str] = {}
    out = []
    limit = min(args.trace_max_blocks, (args.max_model_len - args.output_tokens - 8) // args.trace_block_tokens)
    for i in range(trace.requests):
        nodes = trace.flat[trace.offsets[i] : trace.offsets[i + 1]][:limit]
        parts = []
        for n in nodes:
            if n not in block_text:
                block_text[n] = texts.text(args.trace_block_tokens) + " "
            parts.append(block_text[n])
        out.append(("".join(parts) + "Answer:", args.output_tokens))
    log(
        f"  trace workload: {trace.requests} requests, {len(block_text)} distinct blocks of {args.trace_block_tokens} "
        f"tokens = {len(block_text) * args.trace_block_tokens * KV_PER_TOKEN / 2**20:.0f} MiB of KV"
    )
    return out


def unique_prompts(texts: Texts, args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(texts.text(args.doc_tokens), args.output_tokens) for _ in range(args.unique)]


def vllm_bench(base: str, model: Path, args: argparse.Namespace, concurrency: int, tmp: Path) -> dict[str, Any]:
    """vLLM's own serving benchmark (prefix_repetition), through Python: the ``vllm``
    CLI fails on the CPU build."""
    n_prompts = args.bench_prompts or 3 * args.docs  # every prefix asked about three times
    code = (
        "import json,sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "p = FlexibleArgumentParser(); add_cli_args(p)\n"
        "r = main(p.parse_args(sys.argv[1:]))\n"
        "print('VLLM_BENCH ' + json.dumps({k: v for k, v in r.items() if isinstance(v, (int, float))}))\n"
    )
    cmd = [
        sys.executable,
        "-c",
        code,
        "--backend",
        "vllm",
        "--base-url",
        base,
        "--model",
        str(model),
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(args.doc_tokens),
        "--prefix-repetition-suffix-len",
        "64",
        "--prefix-repetition-num-prefixes",
        str(args.docs),
        "--prefix-repetition-output-len",
        str(args.output_tokens),
        "--num-prompts",
        str(n_prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,itl",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("VLLM_BENCH ")), None)
    if line is None:
        (tmp / "vllm-bench.err").write_text(p.stdout[-5000:] + p.stderr[-5000:])
        return {"error": f"vllm bench failed (exit {p.returncode}); see {tmp / 'vllm-bench.err'}"}
    r = json.loads(line[len("VLLM_BENCH ") :])
    return {
        "requests": r.get("completed"),
        "failed": r.get("failed", 0),
        "req_per_s": r.get("request_throughput"),
        "out_tok_per_s": r.get("output_throughput"),
        "ttft_p50": (r.get("p50_ttft_ms") or float("nan")) / 1e3,
        "ttft_p90": (r.get("p90_ttft_ms") or float("nan")) / 1e3,
        "ttft_p99": (r.get("p99_ttft_ms") or float("nan")) / 1e3,
        "ttft_mean": (r.get("mean_ttft_ms") or float("nan")) / 1e3,
        "itl_p50": (r.get("p50_itl_ms") or float("nan")) / 1e3,
        "itl_p99": (r.get("p99_itl_ms") or float("nan")) / 1e3,
    }


# -- one arm ------------------------------------------------------------------------------
LMCACHE_ARMS = {"lmcache"}  # served by LMCache, not lmcache-core


@contextmanager
def arm_server(arm: Arm, model: Path, args: argparse.Namespace, tmp: Path) -> Iterator[tuple[str, subprocess.Popen, dict]]:
    """The arm's server: (base URL, vLLM's process, other processes of the arm by role)."""
    if arm.name in LMCACHE_ARMS:
        python = lmcache_arm.ensure_env()
        with lmcache_arm.server(arm, model, args, tmp, python) as (base, proc, mp):
            yield base, proc, {"lmcache-server": mp}
    else:
        with server(arm, model, args, tmp) as (base, proc):
            yield base, proc, {}


def run_arm(arm: Arm, model: Path, texts_seed: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    texts = Texts(model, seed=texts_seed)  # the same prompts for every arm
    out: dict[str, Any] = {"arm": arm.name, "runs": {}}
    with arm_server(arm, model, args, tmp) as (base, proc, others):
        name = str(model)

        def usage(measure: Any) -> dict[str, float]:
            """``measure`` (cpu_seconds, rss_mib) by role, the arm's other processes included."""
            u = measure(proc)
            for role, p in others.items():
                u[role] = sum(measure(p).values())
            return u

        def counters() -> dict[str, float]:
            m = http_get(base + "/metrics", timeout=10)
            names = {
                "vllm_hit_tokens": "vllm:prefix_cache_hits_total",
                "loaded_tokens": "lmcache_core:loaded_tokens_total",
                "saved_tokens": "lmcache_core:saved_tokens_total",
                "load_s": "lmcache_core:load_seconds_total",
                "save_s": "lmcache_core:save_seconds_total",
                "prompt_tokens": "vllm:prompt_tokens_total",
                # tokens any connector supplied, as vLLM counts them: one meaning for every arm
                "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
            }
            return {k: metric(m, v) for k, v in names.items()}

        # one warm-up request no workload reuses
        asyncio.run(run_requests(base, name, [(texts.text(64), 4)], 1))
        for wl in args.workloads:
            levels = [max(args.concurrency)] if wl == "unique" else args.concurrency
            for c in levels:
                texts.rng.seed(hash((wl, c)) & 0xFFFF)  # the same prompts per (workload, concurrency)
                c0 = counters()
                cpu0 = usage(cpu_seconds)
                key = f"{wl}@{c}"
                if wl == "docqa":
                    results, wall = asyncio.run(run_requests(base, name, docqa_prompts(texts, args), c))
                    summary = summarize(results, wall)
                    # the first round of questions meets every document for the first time
                    cold, warm = results[: args.docs], results[args.docs :]
                    summary["ttft_p50_cold"] = pct([r.ttft for r in cold if r.error is None], 50)
                    summary["ttft_p50_warm"] = pct([r.ttft for r in warm if r.error is None], 50)
                elif wl == "chat":
                    system, users = chat_users(texts, args, max(c, args.chat_users))
                    results, wall = asyncio.run(run_chat(base, name, users, system, args.output_tokens, c))
                    summary = summarize(results, wall)
                elif wl == "unique":
                    results, wall = asyncio.run(run_requests(base, name, unique_prompts(texts, args), c))
                    summary = summarize(results, wall)
                elif wl == "trace":
                    results, wall = asyncio.run(run_requests(base, name, trace_prompts(texts, args), c))
                    summary = summarize(results, wall)
                elif wl == "vllm-bench":
                    results = []
                    summary = vllm_bench(base, model, args, c, tmp)
                else:
                    raise SystemExit(f"unknown workload {wl}")
                c1 = counters()
                cpu1 = usage(cpu_seconds)
                summary["cpu_s"] = {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1}
                for k in c0:
                    summary[k] = round(c1[k] - c0[k], 3) if k.endswith("_s") else int(c1[k] - c0[k])
                summary["rss_mib"] = {k: round(v) for k, v in usage(rss_mib).items()}
                summary["outputs"] = [r.text for r in results]
                out["runs"][key] = summary
                log(
                    f"  {arm.name:10} {key:14} TTFT p50 {summary.get('ttft_p50', float('nan')):.3f} s  "
                    f"p90 {summary.get('ttft_p90', float('nan')):.3f}  {summary.get('req_per_s') or 0:.2f} req/s  "
                    f"{summary.get('out_tok_per_s') or 0:.1f} tok/s  ITL p99 {summary.get('itl_p99', float('nan')) * 1e3:.1f} ms  "
                    f"hits vLLM {summary['vllm_hit_tokens']} / ours {summary['loaded_tokens']} / connector {summary['external_hit_tokens']}  failed {summary.get('failed')}"
                    + (
                        f"  cold/warm TTFT p50 {summary['ttft_p50_cold']:.3f}/{summary['ttft_p50_warm']:.3f} s"
                        if "ttft_p50_cold" in summary
                        else ""
                    )
                    + f"  load {summary['load_s']:.2f} s save {summary['save_s']:.2f} s  prompt tokens {summary['prompt_tokens']}"
                    + "  CPU s "
                    + " ".join(f"{k} {v:.1f}" for k, v in summary["cpu_s"].items())
                )
    return out


# -- report -------------------------------------------------------------------------------
def json_seconds(merged: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """TTFT p50 and p90 of every arm and workload@concurrency, the figures
    ``--json`` writes (seconds; a run with no TTFT is left out)."""
    out: dict[str, float] = {}
    for arm, runs in merged.items():
        for key, s in runs.items():
            for f in ("ttft_p50", "ttft_p90"):
                v = s.get(f)
                if isinstance(v, (int, float)) and v == v:
                    out[f"{arm} {key} {f}"] = float(v)
    return out


def merge(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """arm -> workload@c -> the median over rounds of each figure (outputs from round 1)."""
    by: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rounds:
        for key, s in r["runs"].items():
            by.setdefault(r["arm"], {}).setdefault(key, []).append(s)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, runs in by.items():
        for key, ss in runs.items():
            m: dict[str, Any] = {}
            for f, v in ss[0].items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    vals = [s[f] for s in ss if isinstance(s.get(f), (int, float))]
                    m[f] = statistics.median(vals) if vals else v
                else:
                    m[f] = v
            m["rounds"] = len(ss)
            pooled = [x for s in ss for x in s.get("itl_ms") or ()]
            m.pop("itl_ms", None)
            if pooled:  # one round's p99 is its few largest gaps: pooled, the rounds' samples together
                m["itl_p99_pooled"] = pct(pooled, 99) / 1e3
                m["itl_samples"] = len(pooled)
            out.setdefault(arm, {})[key] = m
    return out


def report(merged: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace, machine: str) -> list[str]:
    keys = sorted({k for runs in merged.values() for k in runs}, key=lambda k: (k.split("@")[0], int(k.split("@")[1])))
    lines = [f"# bench_serving ({machine})", ""]
    if args.server_env:
        lines += [f"Server environment in every arm: `{' '.join(args.server_env)}`", ""]
    for key in keys:
        lines += [
            f"## {key}",
            "",
            "| arm | TTFT p50 s | p90 | p99 | req/s | out tok/s | ITL p50 ms | ITL p99 ms | vLLM hits | loaded | failed | TTFT p50 / limit | / floor | tok/s / limit | CPU s api/core/worker | RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lim = merged.get("limit", {}).get(key)
        flo = merged.get("floor", {}).get(key)
        van = merged.get("vllm", {}).get(key)
        for arm in args.arms:
            s = merged.get(arm, {}).get(key)
            if not s or "error" in s:
                if s:
                    lines.append(f"| {arm} | {s['error']} |")
                continue

            def ratio(a: dict[str, Any] | None, f: str, s: dict[str, Any] = s) -> str:
                if not a or not a.get(f):
                    return ""
                return f"{s[f] / a[f]:.2f}x"

            rss = "+".join(str(v) for v in s.get("rss_mib", {}).values())
            cpu = s.get("cpu_s", {})
            cpu_txt = "/".join(f"{cpu.get(k, 0):.1f}" for k in ("api", "engine-core", "worker"))
            lines.append(
                f"| {arm} | {s['ttft_p50']:.3f} | {s['ttft_p90']:.3f} | {s['ttft_p99']:.3f} | {s['req_per_s']:.2f} | "
                f"{s['out_tok_per_s']:.1f} | {s['itl_p50'] * 1e3:.1f} | {s['itl_p99'] * 1e3:.1f} | {s['vllm_hit_tokens']} | "
                f"{s['loaded_tokens']} | {s['failed']} | {ratio(lim, 'ttft_p50')} | {ratio(flo, 'ttft_p50')} | "
                f"{ratio(lim, 'out_tok_per_s')} | {cpu_txt} | {rss} |"
            )
            if key.startswith("unique") and van and arm != "vllm":
                lines.append(
                    f"|  vs vllm | | | | | {s['out_tok_per_s'] / van['out_tok_per_s']:.3f}x | | {s['itl_p99'] / van['itl_p99']:.3f}x | | | | | | | | |"
                )
        pooled = [(arm, merged[arm][key]) for arm in args.arms if merged.get(arm, {}).get(key, {}).get("itl_p99_pooled")]
        if pooled:
            base = (van or {}).get("itl_p99_pooled")
            lines += [
                "",
                "ITL p99 pooled over every round's gaps: "
                + ", ".join(
                    f"{arm} {s['itl_p99_pooled'] * 1e3:.1f} ms ({s['itl_samples']} gaps"
                    + (f", {s['itl_p99_pooled'] / base:.3f}x vllm" if base and arm != "vllm" else "")
                    + ")"
                    for arm, s in pooled
                ),
            ]
        outs = {arm: merged[arm][key].get("outputs") for arm in args.arms if key in merged.get(arm, {})}
        outs = {a: o for a, o in outs.items() if o}
        if len(outs) > 1:
            ref_arm, ref = next(iter(outs.items()))
            same = {a: sum(x == y for x, y in zip(o, ref)) for a, o in outs.items()}
            n = len(ref)
            lines += ["", "greedy outputs identical to " + ref_arm + ": " + ", ".join(f"{a} {k}/{n}" for a, k in same.items())]
        lines.append("")
    return lines


def plot(merged: dict[str, dict[str, dict[str, Any]]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted({k for runs in merged.values() for k in runs if not k.startswith("unique")})
    if not keys:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(keys)), 4))
    arms = list(merged)
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        ys = [merged[arm].get(k, {}).get("ttft_p50", float("nan")) for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], ys, width, label=arm)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys, rotation=20)
    ax.set_ylabel("TTFT p50 (s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=120)


ARMS = {
    "vllm": lambda a: Arm("vllm", kv_bytes=a.small_kv),
    "lmc-cpu": lambda a: Arm(
        "lmc-cpu", connector=True, kv_bytes=a.small_kv, tiers="cpu", chunk_size=a.chunk_size, cpu_size=a.cpu_size
    ),
    # lmc-cpu with LRU eviction: the policy's gain side by side (the trace workload)
    "lmc-cpu-lru": lambda a: Arm(
        "lmc-cpu-lru",
        connector=True,
        kv_bytes=a.small_kv,
        tiers="cpu",
        chunk_size=a.chunk_size,
        cpu_size=a.cpu_size,
        eviction="lru",
    ),
    "lmc-disk": lambda a: Arm("lmc-disk", connector=True, kv_bytes=a.small_kv, tiers="disk", chunk_size=a.chunk_size),
    "lmc-node": lambda a: Arm("lmc-node", connector=True, kv_bytes=a.small_kv, tiers="node", chunk_size=a.chunk_size),
    "lmc-redis": lambda a: Arm("lmc-redis", connector=True, kv_bytes=a.small_kv, tiers="redis", chunk_size=a.chunk_size),
    "lmc-cpu-128": lambda a: Arm("lmc-cpu-128", connector=True, kv_bytes=a.small_kv, tiers="cpu", chunk_size=128),
    # lmc-cpu with the --variant settings, to compare them side by side in one run
    "lmc-cpu2": lambda a: Arm(
        "lmc-cpu2", connector=True, kv_bytes=a.small_kv, tiers="cpu", chunk_size=a.chunk_size, overrides=a.variant
    ),
    # LMCache's multiprocess server, its L1 the size of lmc-cpu's CPU tier (bench/lib/lmcache_arm.py)
    "lmcache": lambda a: Arm("lmcache", kv_bytes=a.small_kv, chunk_size=a.chunk_size, cpu_size=a.cpu_size),
    "limit": lambda a: Arm("limit", kv_bytes=a.large_kv),
    # the connector on the limit's cache: what the connector's presence costs when vLLM holds everything
    "lmc-limit": lambda a: Arm("lmc-limit", connector=True, kv_bytes=a.large_kv, tiers="cpu", chunk_size=a.chunk_size),
    "floor": lambda a: Arm("floor", kv_bytes=a.large_kv, max_num_seqs=a.floor_seqs),
}


def quick_defaults(a: argparse.Namespace) -> None:
    """Fill the settings left unset: the full run's, or with ``--quick`` a run of minutes
    that still makes lmcache-core work. Its small cache (32 MiB, about 5,400 tokens of this
    model) is below the documents' KV (6 x 1,040 tokens, 1.1x), so the second round of
    questions misses in vLLM and ``lmc-cpu`` loads; vLLM starts only if one request of
    ``--max-model-len`` fits its cache, hence 4,096. The floor arm is left out: with a
    concurrency of at most 4 it is the limit (the small cache holds 4 requests)."""
    if a.quick:
        a.docs, a.doc_tokens, a.unique, a.chat_users, a.chat_turns, a.bench_prompts = 6, 1000, 8, 4, 3, 0
        a.trace_requests = min(a.trace_requests, 100)
        a.concurrency = [c for c in a.concurrency if c <= 4] or [4]
    if a.arms is None:
        a.arms = ["vllm", "lmc-cpu", "limit"] + ([] if a.quick else ["floor"])
    if a.small_kv is None:
        a.small_kv = (32 if a.quick else 120) << 20
    if a.max_model_len is None:
        a.max_model_len = 4096 if a.quick else 8192


def checks(merged: dict[str, dict[str, dict[str, Any]]], a: argparse.Namespace) -> list[str]:
    """What every run must show: no request failed, in any arm (the figures of a run with
    failures are not comparable); with ``--quick``, that ``lmc-cpu`` loaded tokens on
    doc QA (a quick run that never loads would check nothing of lmcache-core)."""
    failed = {f"{arm} {key}": s.get("failed") for arm, runs in merged.items() for key, s in runs.items()}
    bad = {k: v for k, v in failed.items() if v}
    lines = [f"{'FAIL' if bad else 'PASS'} requests: " + (f"failed in {bad}" if bad else f"none failed ({len(failed)} runs)")]
    missing = [arm for arm in a.arms if not merged.get(arm)]
    if missing:
        lines.append(f"FAIL arms without results: {', '.join(missing)}")
    if a.quick and "lmc-cpu" in a.arms and "docqa" in a.workloads:
        loaded = {k: s.get("loaded_tokens", 0) for k, s in merged.get("lmc-cpu", {}).items() if k.startswith("docqa")}
        ok = bool(loaded) and all(v > 0 for v in loaded.values())
        lines.append(f"{'PASS' if ok else 'FAIL'} lmc-cpu loaded tokens on doc QA: {loaded or 'no doc QA run'}")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arms", nargs="+", default=None, choices=sorted(ARMS), help="default: vllm lmc-cpu limit floor (--quick: no floor)"
    )
    p.add_argument("--workloads", nargs="+", default=["docqa", "chat", "unique", "vllm-bench"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--docs", type=int, default=10)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--questions", type=int, default=2)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--chat-users", type=int, default=8)
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--chat-system-tokens", type=int, default=600)
    p.add_argument("--chat-message-tokens", type=int, default=150)
    p.add_argument("--unique", type=int, default=24)
    p.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")
    p.add_argument("--trace-requests", type=int, default=1000, help="the trace workload's requests (its first ones)")
    p.add_argument("--trace-block-tokens", type=int, default=128, help="tokens per trace block (scaled from 512)")
    p.add_argument("--trace-max-blocks", type=int, default=8, help="blocks of each trace request kept (its first ones)")
    p.add_argument("--cpu-size", default="2GiB", help="the CPU tier of the lmc-cpu arms (and LMCache's L1)")
    p.add_argument("--bench-prompts", type=int, default=0, help="vllm-bench prompts (default: 3 per document)")
    p.add_argument(
        "--small-kv", type=int, default=None, help="vLLM's KV cache in the small arms (bytes; default 120 MiB, --quick 32 MiB)"
    )
    p.add_argument("--large-kv", type=int, default=1 << 30, help="vLLM's KV cache in limit/floor (bytes)")
    p.add_argument("--floor-seqs", type=int, default=0, help="floor's --max-num-seqs (default: what the small cache holds)")
    p.add_argument("--chunk-size", type=int, default=256, help="chunk size (tokens) of the lmc arms and of LMCache")
    p.add_argument("--max-model-len", type=int, default=None, help="default 8192 (--quick: 4096)")
    p.add_argument("--max-batched", type=int, default=2048)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--repeat", type=int, default=1, help="rounds, the arms' order rotating")
    p.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        metavar="K=V",
        help="extra environment for every arm's server (e.g. LD_PRELOAD=... ONEDNN_PRIMITIVE_CACHE_CAPACITY=256)",
    )
    p.add_argument(
        "--variant",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="lmcache-core settings of the lmc-cpu2 arm (dotted keys, YAML values), e.g. connector.async_saves=true",
    )
    p.add_argument(
        "--setup-lmcache",
        action="store_true",
        help="build the lmcache arm's environment (.envs/lmcache) and exit; the arm also builds it on first use",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer, shorter requests; concurrency 1 and 4; a 32 MiB small cache; no floor arm; checks that lmc-cpu loads",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving"))
    p.add_argument("--json", type=Path, default=None, help="also write TTFT p50/p90 per arm and workload (seconds) here")
    return p


def settings(argv: list[str] | None, p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """``argv`` parsed by ``p`` (default: :func:`parser`'s), the unset defaults filled."""
    a = (p or parser()).parse_args(argv)
    quick_defaults(a)
    return a


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = settings(argv, p)
    if a.setup_lmcache or LMCACHE_ARMS & set(a.arms):
        try:
            python = lmcache_arm.ensure_env()
        except lmcache_arm.LMCacheSetupError as err:
            log(f"bench_serving: {err}")
            return 2
        if a.setup_lmcache:
            log(f"LMCache {lmcache_arm.LMCACHE_VERSION}'s environment: {python}")
            return 0
    bad = [kv for kv in a.server_env if "=" not in kv]
    if bad:
        p.error(f"--server-env takes K=V pairs, got {bad}")
    server_env = dict(kv.split("=", 1) for kv in a.server_env)
    bad = [kv for kv in a.variant if "=" not in kv]
    if bad:
        p.error(f"--variant takes KEY=VALUE pairs, got {bad}")
    import yaml

    a.variant = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a.variant)}
    if "lmc-cpu2" in a.arms and not a.variant:
        p.error("the lmc-cpu2 arm is lmc-cpu with --variant settings: give some")
    working_set = a.docs * (a.doc_tokens + 40) * KV_PER_TOKEN
    if not a.floor_seqs:
        a.floor_seqs = floor_seqs(a.small_kv, a.doc_tokens + 64 + a.output_tokens)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model()
    import platform

    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    log(
        f"bench_serving: {machine}; model {model.name}; docqa KV volume {working_set / 2**20:.0f} MiB = "
        f"{working_set / a.small_kv:.1f}x the small cache ({a.small_kv >> 20} MiB); floor --max-num-seqs {a.floor_seqs}; "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU=1 in every arm" + (f"; server environment {server_env}" if server_env else "")
    )
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmpdir:
        tmp = Path(tmpdir)
        for r in range(a.repeat):
            order = a.arms[r % len(a.arms) :] + a.arms[: r % len(a.arms)]
            for name in order:
                arm = ARMS[name](a)
                arm = replace(arm, env={**arm.env, **server_env})
                log(f"round {r + 1}/{a.repeat}: {name}")
                try:
                    rounds.append(run_arm(arm, model, 0, a, tmp))
                except Exception as err:
                    log(f"  {name}: FAILED: {type(err).__name__}: {err}")
                    logs = sorted(tmp.glob(f"{name}.server.log"))
                    if logs:
                        log("\n".join(logs[0].read_text(errors="replace").splitlines()[-15:]))
                for suffix in ("server", "lmcache-server"):  # kept: what each server said (its settings, warnings)
                    server_log = tmp / f"{name}.{suffix}.log"
                    if server_log.exists():
                        (out / "server-logs").mkdir(exist_ok=True)
                        shutil.copy(
                            server_log,
                            out / "server-logs" / f"round{r + 1}-{name}{'' if suffix == 'server' else '.' + suffix}.log",
                        )
        if (tmp / "vllm-bench.err").exists():
            shutil.copy(tmp / "vllm-bench.err", out / "vllm-bench.err")
    merged = merge(rounds)
    lines = report(merged, a, machine) + lmcache_arm.compare_lines(rounds, merged)
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"args": vars(a), "rounds": rounds}, default=str, indent=1))
    plot(merged, out)
    if a.json is not None:  # for bench/tools/before_after.py
        a.json.write_text(json.dumps({"seconds": json_seconds(merged)}, indent=1))
    log("\n".join(lines))
    bars = checks(merged, a)
    log("\n".join(bars))
    return 1 if any(b.startswith("FAIL") for b in bars) else 0


if __name__ == "__main__":
    sys.exit(main())
