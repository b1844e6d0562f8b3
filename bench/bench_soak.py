"""Long fault-injection soak (issue #12): CacheEngine with CPU + disk + peer + S3 tiers
under load from several threads while the peer node is killed and restarted, the S3
endpoint is stopped / slowed / answers 503 / trickles, disk chunk files are corrupted
and the disk is filled, and forged frames are planted in the disk and S3 tiers
(``frame_secret`` on; ``--no-frame-secret`` is the negative control, where the
planted frames with a valid plain checksum are served). Every retrieve is checked
byte for byte. The load generator
and the faults are those of tests/soak/soak.py (the test runs them for 60 s).

Usage: python bench/bench_soak.py [--quick] [--duration S] [--threads N] [--json PATH]

Prints a markdown summary (operations, faults, wrong results, calls over the bound,
p50/p99 latency, peak RSS against the configured budgets). Exit status 1 when a
retrieve returned wrong data or a call overran its bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "soak"))
from soak import FAULTS, launch  # noqa: E402


def table(r: dict) -> str:
    lat = r["latency_ms"]
    rss = r["rss_mb"]
    faults = ", ".join(f"{k} {r['faults'].get(k, 0)}" for k in FAULTS)
    lines = [
        f"| duration | threads | operations (store / lookup / retrieve) | chunks verified | wrong | over {r['bound_s']:.0f} s |",
        "|---|---|---|---|---|---|",
        f"| {r['duration_s']:.0f} s | {r['threads']} | {r['ops']['total']} ({r['ops'].get('store', 0)} / "
        f"{r['ops'].get('lookup', 0)} / {r['ops'].get('retrieve', 0)}) | {r['chunks_verified']} | {r['wrong']} | {r['overruns']} |",
        "",
        "| op | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|",
        *(f"| {op} | {v['p50']} | {v['p99']} | {v['max']} |" for op, v in lat.items()),
        "",
        f"faults injected ({r['faults_total']}): {faults}; forged frames planted: {r['planted_frames']} "
        f"(frame key id {r['frame_key_id'] or 'none: no frame_secret'})",
        f"skipped: {r['skipped'] or 'none'}",
        f"S3 operations cut at op_deadline_s: {r['s3_deadline_overruns_cut']}",
        f"engine RSS: {rss['engine_baseline']} MiB before the engine, peak {rss['engine_peak']} MiB "
        f"(+{rss['engine_growth']} MiB; pool budget {rss['engine_pool_budget']} MiB)",
        f"peer node RSS: peak {rss['node_peak']} MiB, +{rss['node_growth']} MiB over its start "
        f"(budget --max-size + --max-inflight = {rss['node_budget']} MiB)",
        "tier hits: " + ", ".join(f"{k} {v['hits']}" for k, v in r["tiers"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="long fault-injection soak")
    ap.add_argument("--quick", action="store_true", help="60 s instead of the default")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None, help="also write the full report here")
    ap.add_argument(
        "--no-frame-secret",
        action="store_true",
        help="negative control: the engine runs without frame_secret, so planted frames with a valid checksum are served",
    )
    a = ap.parse_args(argv)
    duration = 60.0 if a.quick else a.duration
    with tempfile.TemporaryDirectory(prefix="lmcache-soak-") as d:
        r = launch(duration, Path(d), threads=a.threads, frame_secret=not a.no_frame_secret)
    if a.json is not None:
        a.json.write_text(json.dumps(r, indent=1))
    print(table(r))
    if r["wrong_detail"]:
        print("wrong:", r["wrong_detail"])
    return 1 if r["wrong"] or r["overruns"] or r["hung_workers"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
