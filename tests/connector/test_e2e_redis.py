"""Across processes on real vLLM through Redis: engine A (one process) computes and stores
into a redis-server on loopback; a fresh engine B (another process, empty CPU tier)
loads A's KV from the redis tier and generates the same greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .test_e2e_backends import OBJECTS, _check, _run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from redis_server import RedisServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_redis_tier_across_processes(tiny_model: Path) -> None:
    pytest.importorskip("lmcache_backend_redis")
    server = RedisServer()
    try:
        section = {"name": "redis", "url": server.url, "prefix": "e2e:"}
        cfg = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, section]}
        a = _run(tiny_model, cfg)
        assert a["flushed"]
        assert len(server.client().keys("e2e:v1-*")) == OBJECTS  # the full chunks and block tails of both prompts
        b = _run(tiny_model, cfg)
        _check(a, b, "redis")
        redis_hits = {t["name"]: t["hits"] for t in b["tiers"]}["redis"]
        assert redis_hits == OBJECTS
    finally:
        server.stop()
