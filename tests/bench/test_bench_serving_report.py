"""bench_serving's ITL p99 pooled over rounds: the rounds' gaps together, not a
median of each round's p99 (which is its few largest gaps)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_serving as bs  # noqa: E402
from lib.openai_client import Result  # noqa: E402


def _round(arm: str, gaps: list[float]) -> dict:
    s = bs.summarize([Result(ttft=1.0, itl=gaps, output_tokens=len(gaps) + 1, text="x")], 1.0)
    s.update(vllm_hit_tokens=0, loaded_tokens=0, cpu_s={}, rss_mib={}, outputs=["x"])
    return {"arm": arm, "runs": {"unique@16": s}}


def test_pooled_p99_takes_every_rounds_gaps() -> None:
    # Rounds of 50 gaps: a round's p99 is its largest gap. vLLM alone: one slow gap in
    # each round; lmc-cpu: two slow gaps in one round, none in the other.
    rounds = [
        _round("vllm", [0.02] * 49 + [0.30]),
        _round("vllm", [0.02] * 49 + [0.40]),
        _round("lmc-cpu", [0.02] * 48 + [0.50, 0.60]),
        _round("lmc-cpu", [0.02] * 50),
    ]
    merged = bs.merge(rounds)
    v, lmc = merged["vllm"]["unique@16"], merged["lmc-cpu"]["unique@16"]
    assert v["itl_samples"] == 100 and lmc["itl_samples"] == 100
    assert "itl_ms" not in v  # the raw gaps stay in results.json's rounds only
    # the median of the rounds' p99 says lmc-cpu's tail is shorter (0.31 against 0.35 s)...
    assert abs(v["itl_p99"] - 0.35) < 1e-9 and abs(lmc["itl_p99"] - 0.31) < 1e-9
    # ...the 100 gaps together say it is longer: their 99th percentile is the 2nd largest
    assert v["itl_p99_pooled"] == 0.30 and lmc["itl_p99_pooled"] == 0.50
    text = "\n".join(bs.report(merged, argparse.Namespace(server_env=[], arms=["vllm", "lmc-cpu"]), "test"))
    assert "ITL p99 pooled over every round's gaps: vllm 300.0 ms (100 gaps), lmc-cpu 500.0 ms (100 gaps, 1.667x vllm)" in text


def test_nothing_pooled_without_gaps() -> None:
    """The control: rounds that kept no gaps (vLLM's own benchmark client) print no pooled line."""
    r = _round("vllm", [])
    r["runs"]["unique@16"].pop("itl_ms")
    merged = bs.merge([r])
    assert "itl_p99_pooled" not in merged["vllm"]["unique@16"]
    text = "\n".join(bs.report(merged, argparse.Namespace(server_env=[], arms=["vllm"]), "test"))
    assert "pooled" not in text


def test_quick_run_has_a_cache_below_its_documents() -> None:
    """--quick: the documents' KV exceeds the small cache (so lmc-cpu has to load) and
    one request of max_model_len fits it (or vLLM refuses to start); explicit settings
    win; the full run keeps its own."""
    q = bs.settings(["--quick"])
    working_set = q.docs * (q.doc_tokens + 40) * bs.KV_PER_TOKEN
    assert working_set > q.small_kv >= q.max_model_len * bs.KV_PER_TOKEN
    assert q.arms == ["vllm", "lmc-cpu", "limit"] and q.concurrency == [1, 4]
    full = bs.settings([])
    assert (full.small_kv, full.max_model_len, full.arms[-1]) == (120 << 20, 8192, "floor")
    mine = bs.settings(["--quick", "--small-kv", str(64 << 20), "--max-model-len", "2048", "--arms", "vllm", "floor"])
    assert (mine.small_kv, mine.max_model_len, mine.arms) == (64 << 20, 2048, ["vllm", "floor"])


def test_checks_fail_on_failed_requests_and_a_quick_run_without_loads() -> None:
    def merged(failed: int, loaded: int) -> dict:
        return {
            "vllm": {"docqa@1": {"failed": 0, "loaded_tokens": 0}},
            "lmc-cpu": {"docqa@1": {"failed": failed, "loaded_tokens": loaded}, "chat@1": {"failed": 0, "loaded_tokens": 0}},
        }

    quick = argparse.Namespace(quick=True, arms=["vllm", "lmc-cpu"], workloads=["docqa", "chat"])
    ok = bs.checks(merged(0, 1536), quick)
    assert ok == ["PASS requests: none failed (3 runs)", "PASS lmc-cpu loaded tokens on doc QA: {'docqa@1': 1536}"]
    assert bs.checks(merged(2, 1536), quick)[0].startswith("FAIL requests: failed in {'lmc-cpu docqa@1': 2}")
    assert bs.checks(merged(0, 0), quick)[1].startswith("FAIL lmc-cpu loaded")
    # the full run does not ask for loads (its figures say what loaded); a missing arm fails
    full = argparse.Namespace(quick=False, arms=["vllm", "lmc-cpu", "limit"], workloads=["docqa"])
    assert bs.checks(merged(0, 0), full) == ["PASS requests: none failed (3 runs)", "FAIL arms without results: limit"]
