"""Two engines in two real Python processes share chunks through one redis-server: A
stores with tiers [local_cpu, redis] and flushes; B, with a fresh empty CPU tier, looks
up and retrieves identical bytes from the redis tier (its stats show the hits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixtures

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from lmcache_core.config import load_config
    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import KeyNamespace

    role, section, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "16MiB"}, section]})
    tokens = list(range(2000, 2080))  # 5 chunks of 16 tokens
    shape = (2, 2, 16, 4, 8)
    with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as engine:
        if role == "store":
            g = torch.Generator().manual_seed(99)
            chunks = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(5)]
            report = {"stored": engine.store(tokens, chunks), "flushed": engine.flush(timeout=60)}
            torch.save(chunks, out_path)
        else:
            outs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(5)]
            report = {"hit_tokens": engine.lookup(tokens), "retrieved": engine.retrieve(tokens, outs)}
            torch.save(outs, out_path)
        report["tiers"] = {t["name"]: {"hits": t["hits"], "puts": t["puts"]} for t in engine.stats()["tiers"]}
    print(json.dumps(report))
    """
)


def run_child(role: str, section: dict[str, object], out: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, role, json.dumps(section), str(out)],
        env=dict(os.environ), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_share_chunks_through_redis(redis_server: RedisServer, tmp_path: Path) -> None:
    section = {"name": "redis", "url": redis_server.url, "prefix": "procs:"}
    a = run_child("store", section, tmp_path / "a.pt")
    assert a["stored"] == 5 and a["flushed"] is True
    assert a["tiers"]["redis"]["puts"] == 5  # type: ignore[index]
    assert len(redis_server.client().keys("procs:*")) == 5

    b = run_child("load", section, tmp_path / "b.pt")
    assert b["hit_tokens"] == 80 and b["retrieved"] == 5
    assert b["tiers"]["redis"]["hits"] == 5  # type: ignore[index]
    for x, y in zip(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"), strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
