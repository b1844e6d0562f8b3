"""Two engines in two real Python processes share chunks through the bucket: A stores
with tiers [local_cpu, s3] and flushes; B, with a fresh empty CPU tier, looks up and
retrieves identical bytes (from the s3 tier, as its stats show)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import MotoS3, s3_bucket, s3_server  # noqa: E402,F401 - fixtures

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from lmcache_core.config import load_config
    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens

    role, section, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    cfg = load_config(env={}, overrides={
        "chunk_size": 16,
        "backends": [{"name": "local_cpu", "max_size": "16MiB"}, section],
    })
    tokens = list(range(1000, 1080))  # 5 chunks of 16 tokens
    shape = (2, 2, 16, 4, 8)
    with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as engine:
        if role == "store":
            g = torch.Generator().manual_seed(1234)
            chunks = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(5)]
            stored = store_tokens(engine, tokens, chunks)
            flushed = engine.flush(timeout=60)
            torch.save(chunks, out_path)
            report = {"stored": stored, "flushed": flushed}
        else:
            hit = lookup_tokens(engine, tokens)
            outs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(5)]
            got = retrieve_tokens(engine, tokens, outs)
            torch.save(outs, out_path)
            report = {"hit_tokens": hit, "retrieved": got}
        report["tiers"] = {t["name"]: {"hits": t["hits"], "puts": t["puts"]} for t in engine.stats()["tiers"]}
    print(json.dumps(report))
    """
)


def run_child(role: str, section: dict[str, object], out: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, role, json.dumps(section), str(out)],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_share_chunks_through_the_bucket(s3_server: MotoS3, s3_bucket: str, tmp_path: Path) -> None:
    section = s3_server.section(s3_bucket, prefix="shared")
    a = run_child("store", section, tmp_path / "a.pt")
    assert a["stored"] == 5 and a["flushed"] is True
    assert a["tiers"]["s3"]["puts"] == 5  # type: ignore[index]

    listed = s3_server.client().list_objects_v2(
        Bucket=s3_bucket, Prefix="shared/v1-"
    )  # chunk objects (the namespace record aside)
    assert listed["KeyCount"] == 5

    b = run_child("load", section, tmp_path / "b.pt")
    assert b["hit_tokens"] == 80 and b["retrieved"] == 5
    assert b["tiers"]["s3"]["hits"] == 5  # type: ignore[index]

    stored = torch.load(tmp_path / "a.pt")
    loaded = torch.load(tmp_path / "b.pt")
    for x, y in zip(stored, loaded, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
