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
