"""bench_eviction's trace bars: a whole trace's miss fails the run; the same miss on
``--quick``'s 3,000-request prefix (another, shorter workload) is printed with its
figures as ``MISS (quick)`` and does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_eviction as be  # noqa: E402


def _points(default_hits: int, other_hits: int) -> list[dict[str, object]]:
    return [
        {"share": s, "policy": p, "hits": h, "blocks": 1000, "optimum": 900}
        for s in be.TRACE_SIZES
        for p, h in (("adaptive", default_hits), ("s3fifo", other_hits))
    ]


def test_a_miss_fails_a_whole_trace_and_is_only_shown_on_quick() -> None:
    _, full = be.trace_report("synthetic_trace.jsonl", _points(479, 500), ["adaptive", "s3fifo"], "adaptive")
    _, quick = be.trace_report("synthetic_trace.jsonl", _points(479, 500), ["adaptive", "s3fifo"], "adaptive", quick=True)
    assert full and all(b.startswith("FAIL") and "0.958x" in b for b in full)
    assert quick and all(b.startswith("MISS (quick)") and "0.958x" in b for b in quick)
    # the control: a win passes either way
    _, won = be.trace_report("synthetic_trace.jsonl", _points(510, 500), ["adaptive", "s3fifo"], "adaptive", quick=True)
    assert all(b.startswith("PASS") for b in won)


def _seed_line(env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, str(Path(be.__file__)), "--quick", "--no-traces", "--no-cost", "--policies", "lru"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("hash seed: "))


def test_a_run_prints_the_hash_seed_that_repeats_it() -> None:
    """adaptive's figures on traces follow Python's hash seed: a run without one picks
    its own and prints it; a given one is kept (and printed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    picked = _seed_line(env).split()[2]
    assert picked.startswith("PYTHONHASHSEED=") and picked.removeprefix("PYTHONHASHSEED=").isdigit(), picked
    assert _seed_line({**env, "PYTHONHASHSEED": "7"}).split()[2] == "PYTHONHASHSEED=7"
