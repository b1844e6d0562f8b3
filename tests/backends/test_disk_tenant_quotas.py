"""Hard per-tenant quotas on the disk tier: each tenant's engines get their own
directory under one root (``path: /cache/disk/<tenant>``) with ``max_size`` = the
tenant's quota. Keys of different tenants never meet anyway (each tenant has its own
``tenant_salt``, so its own namespaces), so nothing shareable is lost, and the
directory's shared budget (budget.py) holds the quota for all of that tenant's
processes together.

Measured here: two writers of tenant ``flood`` (two tier instances on one
directory, as two vLLM processes would be) write 10x its quota while ``calm``'s
chunks sit in the next directory; at every sample flood's directory holds at most
its quota, and calm's usage and hit rate do not move. Negative control: the same
flood into one directory shared by both tenants (budget = both quotas) evicts
calm's chunks, so the flood is large enough to matter."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_backend_disk.budget import DirBudget
from lmcache_backend_disk.directory import USAGE
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context

CHUNK = 64 << 10  # bytes of payload per chunk
QUOTA = 2 << 20  # per tenant


def _tier(path: Path, max_size: int) -> DiskBackend:
    return create_disk_backend({"path": str(path), "max_size": max_size, "fsync": False}, make_context())


def _usage(path: Path, budget: DirBudget | None = None) -> int:
    """Bytes of chunk files in ``path``; with ``budget``, listed under the directory's
    budget lock, so the sample is consistent (writers change files only under it)."""
    if budget is None:
        return sum(f.stat().st_size for f in path.rglob("v1-*") if f.is_file())
    with budget.locked():
        return _usage(path)


def _chunk(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _flood_and_watch(flood_dirs: tuple[Path, Path], flood_size: int, calm: DiskBackend, calm_keys: list) -> tuple[int, int]:
    """Two writers of tenant flood write 10x QUOTA between them; the largest usage of
    flood's directory seen between writes, and how many of calm's chunks still hit."""
    ns = KeyNamespace(model="m", layout="t", dtype="u8", salt="flood-salt")
    writers = [_tier(d, flood_size) for d in flood_dirs]
    sampler = DirBudget(flood_dirs[0] / USAGE)
    peak = 0
    lock = threading.Lock()

    def write(w: DiskBackend, base: int) -> None:
        nonlocal peak
        for i in range(10 * QUOTA // CHUNK // 2):
            w.put(ns.key((base + i).to_bytes(16, "little")), _chunk(base + i))
            with lock:
                peak = max(peak, _usage(flood_dirs[0], sampler))

    try:
        threads = [threading.Thread(target=write, args=(w, 100_000 * (j + 1))) for j, w in enumerate(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        for w in writers:
            w.close()
        sampler.close()
    out = torch.empty(CHUNK, dtype=torch.uint8)
    hits = sum(calm.get(k, out) and torch.equal(out, _chunk(i)) for i, k in enumerate(calm_keys))
    return peak, hits


def _fill_calm(path: Path, max_size: int) -> tuple[DiskBackend, list]:
    ns = KeyNamespace(model="m", layout="t", dtype="u8", salt="calm-salt")
    calm = _tier(path, max_size)
    keys = [ns.key(i.to_bytes(16, "little")) for i in range(QUOTA // CHUNK // 2)]  # half its quota
    for i, k in enumerate(keys):
        assert calm.put(k, _chunk(i))
    return calm, keys


def test_a_tenant_writing_10x_its_quota_moves_no_other_tenant(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    calm, keys = _fill_calm(root / "calm", QUOTA)
    try:
        before = _usage(root / "calm")
        peak, hits = _flood_and_watch((root / "flood", root / "flood"), QUOTA, calm, keys)
        assert peak <= QUOTA, peak  # flood's usage within its quota at every sample
        assert _usage(root / "flood") > QUOTA // 2  # it did fill its own share
        assert _usage(root / "calm") == before and hits == len(keys)  # calm: usage and hit rate unmoved
    finally:
        calm.close()


def test_negative_control_one_shared_directory_lets_the_flood_evict_the_other(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    calm, keys = _fill_calm(shared, 2 * QUOTA)
    try:
        _, hits = _flood_and_watch((shared, shared), 2 * QUOTA, calm, keys)
        assert hits < len(keys) // 2, hits  # calm lost most of its chunks to the flood
    finally:
        calm.close()
