"""The short fault-injection soak (about 60 s of load, ~85 s in all).

Four threads drive a CacheEngine with CPU + disk + peer + S3 tiers while the peer
node is SIGKILLed and restarted, the S3 endpoint is stopped, slowed, made to answer
503 and to trickle, disk chunk files are corrupted and the disk (a private 24 MiB
tmpfs) is filled to ENOSPC, and forged frames are planted in the disk and S3 tiers
under real chunk keys while the engine runs with ``frame_secret``. Every retrieved chunk is compared byte for byte with what
was stored for its key. The long run is ``python bench/bench_soak.py``; its report
is in docs/benchmarks.md. moto runs in a child process, so this module imports no
moto and collects in either phase of tests/run.py (it has no ``vllm`` marker)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import BOUND_S, FAULTS, launch  # noqa: E402

import pytest  # noqa: E402

pytestmark = pytest.mark.slow

DURATION_S = 60.0
RSS_MARGIN_MIB = 96  # interpreter, boto3/botocore clients, thread stacks, disk index beyond the pool


def test_short_soak_under_faults_serves_no_wrong_data_and_no_overruns(tmp_path: Path) -> None:
    r = launch(DURATION_S, tmp_path, threads=4, timeout_s=DURATION_S + 100)
    summary = {
        k: r[k]
        for k in (
            "ops",
            "wrong",
            "overruns",
            "faults",
            "skipped",
            "latency_ms",
            "rss_mb",
            "tiers",
            "timings",
            "s3_deadline_overruns_cut",
        )
    }
    print(json.dumps(summary))
    assert r["wrong"] == 0, r["wrong_detail"]
    assert r["frame_key_id"] and (r["planted_frames"] > 0 or "planted_frame" in r["skipped"]), r["planted_frames"]
    assert r["overruns"] == 0 and r["latency_ms"]["all"]["max"] < BOUND_S * 1000
    assert r["hung_workers"] == 0
    assert r["ops"]["total"] >= 2000 and r["chunks_verified"] >= 2000
    for fault in FAULTS:  # every kind of fault was injected (disk-full only where a tmpfs can be mounted)
        assert r["faults"].get(fault, 0) >= 1 or fault in r["skipped"], (fault, r["faults"], r["skipped"])
    # Every tier served reads at some point, so each fault met real traffic.
    assert all(t["hits"] > 0 for t in r["tiers"].values()), r["tiers"]
    rss = r["rss_mb"]
    assert rss["engine_growth"] <= rss["engine_pool_budget"] + RSS_MARGIN_MIB, rss
    assert rss["node_growth"] <= rss["node_budget"] + 16, rss  # + allocator slack of the node's interpreter
