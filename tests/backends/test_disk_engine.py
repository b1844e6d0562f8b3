"""Through the engine: CPU tier + disk tier (found through its entry point); data
stored by one engine is retrieved, identical, by a new engine after a restart."""

from __future__ import annotations

from pathlib import Path

import torch

from lmcache_core.config import load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import KeyNamespace
from lmcache_core.plugins import get_plugin_manager
from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens, token_hashes

CHUNK = 256
SHAPE = (2, 2, CHUNK, 4, 16)  # [layers, k/v, tokens, kv_heads, head_size]


def engine(disk: Path) -> CacheEngine:
    cfg = load_config(
        overrides={
            "chunk_size": CHUNK,
            "backends": [{"name": "local_cpu", "max_size": "64MiB"}, {"name": "disk", "path": str(disk)}],
        }
    )
    return CacheEngine(cfg, namespace=KeyNamespace(model="m"))


def test_disk_plugin_comes_from_its_entry_point() -> None:
    info = get_plugin_manager().backends()["disk"]
    assert info.origin.distribution == "lmcache-backend-disk"


def test_store_flush_restart_retrieve_identical(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    tokens = list(range(1000, 1000 + 4 * CHUNK))
    g = torch.Generator().manual_seed(7)
    chunks = [torch.randn(SHAPE, generator=g).to(torch.bfloat16) for _ in range(4)]

    e1 = engine(disk)
    try:
        assert store_tokens(e1, tokens, chunks) == 4
        assert e1.flush(timeout=60)
        disk_stats = next(t for t in e1.stats()["tiers"] if t["name"] == "disk")
        assert disk_stats["puts"] == 4
    finally:
        e1.close()

    e2 = engine(disk)
    try:
        cpu, dsk = e2.tiers
        assert cpu.stats().chunks == 0
        assert lookup_tokens(e2, tokens) == 4 * CHUNK  # served whether or not the background scan is over
        assert dsk.wait_for_scan(60) and dsk.stats().chunks == 4
        outs = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(4)]
        assert retrieve_tokens(e2, tokens, outs) == 4
        for got, want in zip(outs, chunks):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert dsk.stats().hits == 4
        assert cpu.stats().chunks == 4  # promoted into the CPU tier
        other = list(range(5000, 5000 + 2 * CHUNK))
        assert lookup_tokens(e2, other) == 0
    finally:
        e2.close()


def test_corrupt_disk_chunk_is_recomputed_not_loaded(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    tokens = list(range(3 * CHUNK))
    chunks = [torch.full(SHAPE, float(i), dtype=torch.float16) for i in range(3)]
    e1 = engine(disk)
    store_tokens(e1, tokens, chunks)
    assert e1.flush(timeout=60)
    key = e1.keys(token_hashes(e1, tokens))[1]
    path = e1.tiers[1].directory.chunk_path(key)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))

    e1.close()

    e2 = engine(disk)
    try:
        outs = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(3)]
        assert retrieve_tokens(e2, tokens, outs) == 1  # chunk 1 is corrupt: only chunk 0 loads
        assert torch.equal(outs[0], chunks[0])
        assert not path.exists()
        assert lookup_tokens(e2, tokens) == CHUNK
    finally:
        e2.close()


def test_engine_close_during_the_start_up_scan_leaves_no_scan_thread(tmp_path: Path) -> None:
    import threading
    import time

    disk = tmp_path / "disk"
    e1 = engine(disk)
    try:
        tokens = list(range(40 * CHUNK))
        g = torch.Generator().manual_seed(3)
        assert store_tokens(e1, tokens, [torch.randn(SHAPE, generator=g) for _ in range(40)]) == 40
        assert e1.flush(timeout=60)
    finally:
        e1.close()
    cfg = load_config(
        overrides={
            "chunk_size": CHUNK,
            "backends": [{"name": "local_cpu", "max_size": "64MiB"}, {"name": "disk", "path": str(disk), "scan_rate": 4}],
        }
    )
    e2 = CacheEngine(cfg, namespace=KeyNamespace(model="m"))  # about 10 s to scan 40 files
    dsk = e2.tiers[1]
    try:
        assert dsk.stats().extra["scan_state"] == "indexing"
        scan = dsk._scan_thread
        assert scan is not None and scan in threading.enumerate(), "negative control: the scan runs"
    finally:
        t0 = time.perf_counter()
        e2.close()
    assert time.perf_counter() - t0 < 5
    assert not scan.is_alive() and scan not in threading.enumerate()
    assert dsk.stats().extra["scan_state"] == "stopped"
