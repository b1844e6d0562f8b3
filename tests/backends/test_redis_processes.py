"""Two engines in two real Python processes share chunks through one redis-server: A
(this test process) stores with tiers [local_cpu, redis] and flushes; B (a child
process, fresh empty CPU tier) looks up and retrieves identical bytes from the redis
tier (its stats show the hits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixtures

from lmcache_core.config import load_config  # noqa: E402
from lmcache_core.engine import CacheEngine  # noqa: E402
from lmcache_core.keys import KeyNamespace  # noqa: E402
from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens  # noqa: E402

TOKENS = list(range(2000, 2080))  # 5 chunks of 16 tokens
SHAPE = (2, 2, 16, 4, 8)
CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from test_redis_processes import child_main; child_main()"


def run_engine(role: str, section: dict[str, Any], out_path: Path) -> dict[str, Any]:
    """Store (``role == "store"``) or look up and retrieve the 5 chunks; the chunks go
    to ``out_path`` with ``torch.save``."""
    cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "16MiB"}, section]})
    with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as engine:
        if role == "store":
            g = torch.Generator().manual_seed(99)
            chunks = [torch.randn(SHAPE, generator=g).to(torch.bfloat16) for _ in range(5)]
            report: dict[str, Any] = {"stored": store_tokens(engine, TOKENS, chunks), "flushed": engine.flush(timeout=60)}
        else:
            chunks = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(5)]
            report = {"hit_tokens": lookup_tokens(engine, TOKENS), "retrieved": retrieve_tokens(engine, TOKENS, chunks)}
        torch.save(chunks, out_path)
        report["tiers"] = {t["name"]: {"hits": t["hits"], "puts": t["puts"]} for t in engine.stats()["tiers"]}  # type: ignore[attr-defined]
    return report


def child_main() -> None:
    print(json.dumps(run_engine(sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4]))))


def test_two_processes_share_chunks_through_redis(redis_server: RedisServer, tmp_path: Path) -> None:
    section = {"name": "redis", "url": redis_server.url, "prefix": "procs:"}
    a = run_engine("store", section, tmp_path / "a.pt")
    assert a["stored"] == 5 and a["flushed"] is True
    assert a["tiers"]["redis"]["puts"] == 5
    assert len(redis_server.client().keys("procs:v1-*")) == 5  # chunk keys (the namespace record aside)

    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(Path(__file__).parent), "load", json.dumps(section), str(tmp_path / "b.pt")],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    b = json.loads(proc.stdout.strip().splitlines()[-1])
    assert b["hit_tokens"] == 80 and b["retrieved"] == 5
    assert b["tiers"]["redis"]["hits"] == 5
    for x, y in zip(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"), strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
