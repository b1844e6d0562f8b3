"""Two engines in two real Python processes share chunks through a real Mooncake
Store: A stores with tiers [local_cpu, mooncake], flushes and exits; B, with a fresh
empty CPU tier, looks up and retrieves identical bytes from the mooncake tier. The
chunks live in a segment owner's DRAM, so they outlive A. Negative control: an
engine under another key prefix (in B's process) sees none of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from mooncake_server import MooncakeMaster, mooncake_store  # noqa: E402,F401 - fixture

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
            if role == "load-and-other":  # negative control: another key prefix, same process
                other = dict(section, key_prefix="other/")
                ocfg = load_config(env={}, overrides={
                    "chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "16MiB"}, other],
                })
                with CacheEngine(ocfg, namespace=KeyNamespace(model="m")) as oengine:
                    report["other_hit_tokens"] = lookup_tokens(oengine, tokens)
        report["tiers"] = {t["name"]: {"hits": t["hits"], "puts": t["puts"]} for t in engine.stats()["tiers"]}
    print(json.dumps(report))
    """
)


def run_child(role: str, section: dict[str, object], out: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, role, json.dumps(section), str(out)],
        env={**os.environ, "GLOG_minloglevel": "2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_share_chunks_through_the_store(mooncake_store: MooncakeMaster, tmp_path: Path) -> None:
    section = mooncake_store.section(key_prefix="shared/")
    a = run_child("store", section, tmp_path / "a.pt")
    assert a["stored"] == 5 and a["flushed"] is True
    assert a["tiers"]["mooncake"]["puts"] == 5  # type: ignore[index]

    b = run_child("load-and-other", section, tmp_path / "b.pt")
    assert b["hit_tokens"] == 80 and b["retrieved"] == 5
    assert b["tiers"]["mooncake"]["hits"] == 5  # type: ignore[index]
    stored, loaded = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for s, g in zip(stored, loaded):
        assert torch.equal(s.view(torch.int16), g.view(torch.int16))
    assert b["other_hit_tokens"] == 0
