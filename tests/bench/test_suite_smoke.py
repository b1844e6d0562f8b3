"""Fast smoke test of the benchmark suite's tables and plots on synthetic numbers (no vLLM)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[2] / "bench" / "suite" / "report.py"


def _report():
    spec = importlib.util.spec_from_file_location("bench_suite_report", REPORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(system: str, workload: str, cold: float, warm: float, hit: float) -> dict:
    reqs = []
    for q in range(3):
        for d, n in enumerate((1000, 2000)):
            w = q > 0
            reqs.append(
                {
                    "prompt_tokens": n,
                    "cached_tokens": int(n * hit) if w else 0,
                    "ttft_s": (warm if w else cold) * n / 1000,
                    "warm": w,
                    "group": d,
                }
            )
    return {
        "system": system,
        "workload": workload,
        "requests": reqs,
        "total_s": sum(r["ttft_s"] for r in reqs),
        "tiers": [{"name": "local_cpu", "put_bytes": 3 << 20, "get_bytes": 6 << 20, "evictions": 0}]
        if system.startswith("lmc")
        else [],
    }


def test_percentile_and_summary():
    rep = _report()
    assert rep.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert rep.percentile([5.0], 95) == 5.0
    s = rep.summarize(_run("lmc-cpu", "docqa", 1.0, 0.1, 0.9))
    assert s["n"] == 6
    assert s["hit_rate"] == pytest.approx((900 + 1800) * 2 / 9000)
    assert s["warm_hit_rate"] == pytest.approx(0.9)
    assert s["warm_mean"] == pytest.approx(0.15)


def test_tables_and_plots(tmp_path: Path):
    pytest.importorskip("matplotlib")
    rep = _report()
    runs = [
        _run("recompute", "docqa", 1.0, 1.0, 0.0),
        _run("vllm-prefix-cache", "docqa", 1.0, 0.05, 0.95),
        _run("lmc-cpu", "docqa", 1.0, 0.1, 0.9),
    ]
    md = rep.workload_tables(runs, "docqa")
    assert "| lmc-cpu | 6 |" in md
    ratio_row = next(line for line in md.splitlines() if line.startswith("| lmc-cpu |") and "x |" in line)
    # mean TTFT: lmc-cpu (3 + 0.6) / 6 = 0.6 s, recompute 9 / 6 = 1.5 s
    assert ratio_row.startswith("| lmc-cpu | 0.40x |")
    assert "| recompute | 1.00x | 1.00x | 1.00x |" in md
    assert "local_cpu 3.0 MiB" in md and "local_cpu 6.0 MiB" in md
    points = [
        {
            "disk": d,
            "fraction": f,
            "cpu_bytes": int(f * (64 << 20)),
            "working_set_bytes": 64 << 20,
            "hit_rate": (0.5 if d or f >= 1 else 0.0),
            "ttft_mean_s": 0.3,
            "warm_ttft_mean_s": 0.1,
            "tiers": [{"name": "local_cpu", "get_bytes": 1 << 20, "evictions": 3}],
        }
        for d in (False, True)
        for f in (0.25, 0.5, 1.0, 2.0)
    ]
    table = rep.sweep_table(points)
    assert table.count("\n") == 2 + len(points) - 1
    assert "local_cpu + disk | 25%" in table
    p1 = rep.plot_ttft_vs_context(runs, tmp_path / "ttft.png", {"docqa": "doc QA"})
    p2 = rep.plot_sweep(points, tmp_path / "sweep.png", 0.5)
    for p in (p1, p2):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
