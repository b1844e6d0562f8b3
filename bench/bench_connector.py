"""Warm TTFT on real vLLM (CPU), side by side in one run, same model and prompts:

* recompute: no connector, vLLM prefix caching off (the cold baseline)
* ExampleConnector: vLLM's built-in debug connector (safetensors files)
* lmcache-core: this connector, CPU tier (vLLM prefix caching off, so hits are ours)
* vLLM prefix cache: vLLM's own in-engine cache (the upper bound)

and a no-reuse workload (all prompts distinct) with and without the connector, run
alternately. Targets: lmcache-core's warm TTFT within 1.5x of vLLM's prefix-cache
hit; no-reuse TTFT within 5% of no connector.

    python bench/bench_connector.py [--quick] [--json PATH]

``--json`` also writes the medians (seconds) for bench/tools/before_after.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from lib.vllm_engine import SPEC, close, engine, ttft  # noqa: E402  (sets vLLM's env defaults first)
from lmcache_connector.dev.tiny_model import build_tiny_model, random_prompt  # noqa: E402


def reuse_workload(model: Path, tmp: Path, docs: list[list[int]], repeats: int, max_len: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for system in ("recompute", "example", "lmcache", "vllm-prefix-cache"):
        print(f"  {system} ...", flush=True)
        llm = engine(model, system, tmp, max_len)
        ttft(llm, random_prompt(64, 7, SPEC.vocab_size))  # warm-up
        cold, warm, cached = [], [], []
        for d in docs:
            t, _ = ttft(llm, d)
            cold.append(t)
        for _ in range(repeats):
            for d in docs:
                t, c = ttft(llm, d)
                warm.append(t)
                cached.append(c)
        close(llm)
        out[system] = {"cold": statistics.median(cold), "warm": statistics.median(warm), "cached": statistics.median(cached)}
    return out


def no_reuse_workload(model: Path, tmp: Path, n: int, tokens: int, rounds: int, max_len: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"recompute": [], "lmcache": []}
    seed = 10_000
    for r in range(rounds):
        for system in ("recompute", "lmcache") if r % 2 == 0 else ("lmcache", "recompute"):
            llm = engine(model, system, tmp, max_len)
            ttft(llm, random_prompt(64, 7, SPEC.vocab_size))
            for _ in range(n):
                seed += 1
                t, c = ttft(llm, random_prompt(tokens, seed, SPEC.vocab_size))
                assert c == 0, "no-reuse prompts must not hit"
                times[system].append(t)
            close(llm)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the medians (seconds) here")
    args = ap.parse_args()
    n_docs, doc_tokens, repeats = (2, 1536, 2) if args.quick else (4, 3072, 3)
    nr_n, nr_tokens, nr_rounds = (4, 1024, 2) if args.quick else (6, 2048, 4)
    tmp = Path(tempfile.mkdtemp(prefix="lmcache-bench-"))
    model = build_tiny_model(Path.home() / ".cache" / "lmcache-core" / SPEC.tag(), SPEC)
    max_len = doc_tokens + 64
    docs = [random_prompt(doc_tokens, 100 + i, SPEC.vocab_size) for i in range(n_docs)]
    print(f"model {SPEC.tag()}, {n_docs} documents x {doc_tokens} tokens, warm = median of {repeats} repeats", flush=True)
    res = reuse_workload(model, tmp, docs, repeats, max_len)
    base = res["recompute"]["cold"]
    upper = res["vllm-prefix-cache"]["warm"]
    print("\nwarm TTFT (same prompt again), medians")
    print(f"{'system':<20}{'cold ms':>10}{'warm ms':>10}{'warm/recompute':>16}{'warm/vLLM-prefix':>18}{'cached tok':>12}")
    for name, r in res.items():
        print(
            f"{name:<20}{r['cold'] * 1000:>10.1f}{r['warm'] * 1000:>10.1f}"
            f"{r['warm'] / base:>16.3f}{r['warm'] / upper:>18.2f}{int(r['cached']):>12}"
        )
    ratio = res["lmcache"]["warm"] / upper
    print(
        f"target: lmcache-core warm TTFT <= 1.5x vLLM prefix-cache hit -> {ratio:.2f}x ({'met' if ratio <= 1.5 else 'NOT met'})"
    )
    print(f"lmcache-core vs ExampleConnector warm: {res['lmcache']['warm'] / res['example']['warm']:.2f}x")

    print(f"\nno-reuse workload: {nr_n} distinct prompts x {nr_tokens} tokens, {nr_rounds} alternating rounds", flush=True)
    nr = no_reuse_workload(model, tmp, nr_n, nr_tokens, nr_rounds, max(max_len, nr_tokens + 64))
    over = nr["lmcache"] / nr["recompute"]
    print(
        f"TTFT median: no connector {nr['recompute'] * 1000:.1f} ms, lmcache-core {nr['lmcache'] * 1000:.1f} ms, ratio {over:.3f}"
    )
    print(f"target: within 5% of no connector -> {'met' if over <= 1.05 else 'NOT met'}")
    if args.json is not None:
        metrics = {f"{name} {phase} TTFT": r[phase] for name, r in res.items() for phase in ("cold", "warm")}
        metrics |= {"no-reuse TTFT, no connector": nr["recompute"], "no-reuse TTFT, lmcache-core": nr["lmcache"]}
        args.json.write_text(json.dumps({"seconds": metrics, "ratios": {"no-reuse lmcache/recompute": over}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
