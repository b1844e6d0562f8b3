"""Tables and plots of the benchmark suite, from plain result dicts (no vLLM here).

A *run* is one system on one workload on a fresh engine::

    {"system": "lmc-cpu", "workload": "docqa",
     "requests": [{"prompt_tokens": int, "cached_tokens": int, "ttft_s": float,
                   "warm": bool, "group": int}, ...],
     "total_s": float,
     "tiers": [{"name": "local_cpu", "put_bytes": int, "get_bytes": int, "evictions": int}, ...]}

``warm`` marks a request whose prefix was seen before (a repeat query of a document,
a later chat round); ``group`` is the document (doc QA) or round (chat) it belongs to,
used for the TTFT-vs-context plot. A *sweep point*::

    {"disk": bool, "fraction": 0.25, "cpu_bytes": int, "working_set_bytes": int,
     "hit_rate": float, "ttft_mean_s": float, "warm_ttft_mean_s": float, "tiers": [...]}
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

RECOMPUTE = "recompute"
PREFIX = "vllm-prefix-cache"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    reqs = run["requests"]
    ttft = [r["ttft_s"] for r in reqs]
    warm = [r["ttft_s"] for r in reqs if r["warm"]]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached_tokens"] for r in reqs)
    warm_prompt = sum(r["prompt_tokens"] for r in reqs if r["warm"])
    warm_cached = sum(r["cached_tokens"] for r in reqs if r["warm"])
    return {
        "system": run["system"],
        "workload": run["workload"],
        "n": len(reqs),
        "prompt_tokens": prompt,
        "hit_rate": cached / prompt if prompt else 0.0,
        "warm_hit_rate": warm_cached / warm_prompt if warm_prompt else 0.0,
        "mean": statistics.fmean(ttft) if ttft else float("nan"),
        "p50": percentile(ttft, 50),
        "p95": percentile(ttft, 95),
        "warm_mean": statistics.fmean(warm) if warm else float("nan"),
        "total_s": run["total_s"],
        "tiers": run.get("tiers", []),
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(a: float, b: float) -> str:
    if not b or math.isnan(b) or math.isnan(a):
        return "-"
    return f"{a / b:.2f}x"


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1000:.0f}"


def _tiers(tiers: Iterable[dict[str, Any]], key: str) -> str:
    parts = [f"{t['name']} {fmt_bytes(t.get(key, 0))}" for t in tiers if t.get(key, 0)]
    return ", ".join(parts) or "-"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    right = [i > 0 for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def workload_tables(runs: list[dict[str, Any]], workload: str) -> str:
    """Markdown: the main table and the ratio table of one workload."""
    sums = [summarize(r) for r in runs if r["workload"] == workload]
    if not sums:
        return ""
    base = {s["system"]: s for s in sums}
    rec, pre = base.get(RECOMPUTE), base.get(PREFIX)
    main_rows, ratio_rows = [], []
    for s in sums:
        main_rows.append(
            [
                s["system"],
                str(s["n"]),
                f"{s['hit_rate'] * 100:.1f}%",
                _ms(s["mean"]),
                _ms(s["p50"]),
                _ms(s["p95"]),
                _ms(s["warm_mean"]),
                f"{s['total_s']:.1f}",
                _tiers(s["tiers"], "put_bytes"),
                _tiers(s["tiers"], "get_bytes"),
            ]
        )
        row = [s["system"]]
        for ref in (rec, pre):
            for k in ("mean", "p50", "p95"):
                row.append(_ratio(s[k], ref[k]) if ref else "-")
        ratio_rows.append(row)
    main = md_table(
        [
            "system",
            "requests",
            "hit rate",
            "TTFT mean ms",
            "p50 ms",
            "p95 ms",
            "warm mean ms",
            "total s",
            "bytes written (per tier)",
            "bytes read (per tier)",
        ],
        main_rows,
    )
    ratios = md_table(
        [
            "system",
            "mean / recompute",
            "p50 / recompute",
            "p95 / recompute",
            "mean / prefix cache",
            "p50 / prefix cache",
            "p95 / prefix cache",
        ],
        ratio_rows,
    )
    return f"{main}\n\nTTFT as a ratio (lower is better):\n\n{ratios}\n"


def sweep_table(points: list[dict[str, Any]]) -> str:
    rows = []
    key = lambda p: (p.get("workload", "docqa"), p["disk"], p["fraction"], p.get("policy", ""))  # noqa: E731
    for p in sorted(points, key=key):
        rows.append(
            [
                p.get("workload", "docqa"),
                "local_cpu + disk" if p["disk"] else "local_cpu only",
                f"{p['fraction'] * 100:.0f}%",
                p.get("policy", "lru"),
                fmt_bytes(p["cpu_bytes"]),
                f"{p['hit_rate'] * 100:.1f}%",
                f"{p.get('warm_hit_rate', float('nan')) * 100:.1f}%",
                _ms(p["ttft_mean_s"]),
                _ms(p["warm_ttft_mean_s"]),
                str(sum(t.get("evictions", 0) for t in p["tiers"] if t["name"] == "local_cpu")),
                _tiers(p["tiers"], "get_bytes"),
            ]
        )
    return md_table(
        [
            "workload",
            "tiers",
            "CPU tier / working set",
            "eviction",
            "CPU tier size",
            "hit rate",
            "warm hit rate",
            "TTFT mean ms",
            "warm mean ms",
            "CPU evictions",
            "bytes read (per tier)",
        ],
        rows,
    )


def policy_bars(points: list[dict[str, Any]], policy: str, baseline: str = "lru") -> list[str]:
    """Issue #16's bars on the CPU-only sweep, as PASS/FAIL lines with the figures:
    ``policy`` serves >= 40% of the warm doc-QA tokens at 50% of the working set, and
    never fewer chat tokens than ``baseline`` at any size."""
    by = {(p.get("workload", "docqa"), p["fraction"], p.get("policy")): p for p in points if not p["disk"]}
    out = []
    d = by.get(("docqa", 0.5, policy))
    if d is not None:
        ok = d["warm_hit_rate"] >= 0.40
        base = by.get(("docqa", 0.5, baseline))
        vs = f"; {baseline} {base['warm_hit_rate'] * 100:.1f}%" if base else ""
        out.append(
            f"{'PASS' if ok else 'FAIL'} doc QA at 50% of the working set: {policy} serves {d['warm_hit_rate'] * 100:.1f}% of warm tokens (bar >= 40%{vs})"
        )
    for f in sorted({p["fraction"] for p in points}):
        a, b = by.get(("chat", f, policy)), by.get(("chat", f, baseline))
        if a is None or b is None:
            continue
        ok = a["hit_rate"] >= b["hit_rate"]
        out.append(
            f"{'PASS' if ok else 'FAIL'} chat at {f * 100:.0f}%: {policy} serves {a['hit_rate'] * 100:.1f}% of tokens, {baseline} {b['hit_rate'] * 100:.1f}% (bar: not fewer)"
        )
    return out


def _groups(run: dict[str, Any]) -> list[tuple[float, float]]:
    """(mean prompt tokens, median TTFT ms) of the warm requests of each group."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in run["requests"]:
        if r["warm"]:
            by.setdefault(r["group"], []).append(r)
    pts = []
    for reqs in by.values():
        pts.append((statistics.fmean(r["prompt_tokens"] for r in reqs), statistics.median(r["ttft_s"] for r in reqs) * 1000))
    return sorted(pts)


def plot_ttft_vs_context(runs: list[dict[str, Any]], path: Path, titles: dict[str, str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in titles if any(r["workload"] == w for r in runs)]
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(6.2 * max(1, len(workloads)), 4.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for run in (r for r in runs if r["workload"] == w):
            pts = _groups(run)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run["system"])
        ax.set_title(titles[w])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT, repeat requests (median, ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_sweep(points: list[dict[str, Any]], path: Path, unlimited_hit_rate: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    doc = [p for p in points if p.get("workload", "docqa") == "docqa"]
    series = sorted({(p["disk"], p.get("policy", "")) for p in doc})
    for disk, policy in series:
        pts = sorted((p for p in doc if p["disk"] == disk and p.get("policy", "") == policy), key=lambda p: p["fraction"])
        label = ("local_cpu + disk" if disk else "local_cpu only") + (f", {policy}" if policy else "")
        xs = [p["fraction"] * 100 for p in pts]
        a1.plot(xs, [p["hit_rate"] * 100 for p in pts], marker="o", label=label)
        a2.plot(xs, [p["warm_ttft_mean_s"] * 1000 for p in pts], marker="o", label=label)
    if unlimited_hit_rate is not None:
        a1.axhline(unlimited_hit_rate * 100, color="grey", ls="--", lw=1, label="unlimited CPU tier")
    ticks = sorted({p["fraction"] * 100 for p in points})
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
        ax.minorticks_off()
    a1.set_xlabel("CPU tier size, % of the working set's KV bytes")
    a1.set_ylabel("hit rate (% of prompt tokens)")
    a1.set_ylim(bottom=0)
    a2.set_xlabel("CPU tier size, % of the working set's KV bytes")
    a2.set_ylabel("TTFT mean, repeat requests (ms)")
    a2.set_ylim(bottom=0)
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    a1.set_title("hit rate vs cache size (doc QA)")
    a2.set_title("TTFT vs cache size (doc QA)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def replot(folder: Path) -> None:
    """Redraw the plots of a results folder from its ``results.json``."""
    import json

    data = json.loads((folder / "results.json").read_text())
    titles = data.get("titles") or {"docqa": "long-document QA", "chat": "multi-round chat"}
    plot_ttft_vs_context(data["runs"], folder / "ttft_vs_context.png", titles)
    if data.get("sweep"):
        plot_sweep(data["sweep"], folder / "hit_rate_vs_cache_size.png", data.get("unlimited_hit_rate"))


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        replot(Path(arg))
