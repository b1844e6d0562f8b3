"""The disk tier passes the shared backend conformance suite (persistent)."""

from __future__ import annotations

from pathlib import Path

from lmcache_backend_disk import create_disk_backend
from lmcache_core.backend import BackendContext, StorageBackend
from lmcache_core.testing import BackendConformance


class TestDiskConformance(BackendConformance):
    persistent = True

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_disk_backend({"path": str(tmp_path / "tier"), "max_size": "256MiB"}, ctx)


class TestDiskConformanceLz4ODirect(BackendConformance):
    persistent = True
    codec = "lz4"

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_disk_backend(
            {"path": str(tmp_path / "tier"), "max_size": "256MiB", "o_direct": True, "fsync": False}, ctx
        )
