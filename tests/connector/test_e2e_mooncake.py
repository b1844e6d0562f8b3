"""Across processes on real vLLM through a real Mooncake Store: engine A (one
process) computes and stores with tiers [local_cpu, mooncake] and exits; a fresh
engine B (another process, empty CPU tier) loads A's KV from the store (the chunks
live in a segment owner's DRAM, beside the master on loopback) and generates the
same greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .test_e2e_backends import OBJECTS, _check, _run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from mooncake_server import MooncakeMaster, SegmentOwner  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_mooncake_tier_across_processes(tiny_model, tmp_path):
    pytest.importorskip("lmcache_backend_mooncake")
    master = MooncakeMaster(tmp_path)
    owner = SegmentOwner(master, size_mib=128)
    try:
        cfg = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, master.section(key_prefix="e2e/")]}
        env = {"GLOG_minloglevel": "2"}
        a = _run(tiny_model, cfg, env)
        assert a["flushed"]
        puts = {t["name"]: t["puts"] for t in a["tiers"]}
        assert puts.get("mooncake") == OBJECTS  # every chunk and block tail of both prompts reached the store
        b = _run(tiny_model, cfg, env)
        _check(a, b, "mooncake")
    finally:
        owner.kill()
        master.kill()
