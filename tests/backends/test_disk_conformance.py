"""The disk tier passes the shared backend conformance suite (persistent), with the
storage fixtures reaching its chunk files."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_core.backend import BackendContext, StorageBackend
from lmcache_core.keys import ChunkKey
from lmcache_core.testing import BackendConformance, Corrupt, Plant, ReplaceWith, flip_byte


def scanned(backend: StorageBackend) -> StorageBackend:
    """The tier once its background start-up scan is over: the storage fixtures rewrite
    chunk files in place, which a scan still running could read half-written (and
    rightly remove as truncated)."""
    assert isinstance(backend, DiskBackend) and backend.wait_for_scan(60)
    return backend


class TestDiskConformance(BackendConformance):
    persistent = True

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return scanned(create_disk_backend({"path": str(tmp_path / "tier"), "max_size": "256MiB"}, ctx))

    def make_bounded_backend(self, ctx: BackendContext, tmp_path: Path, max_bytes: int) -> StorageBackend:
        return scanned(create_disk_backend({"path": str(tmp_path / "bounded"), "max_size": max_bytes}, ctx))

    @pytest.fixture
    def corrupt(self, backend: DiskBackend) -> Corrupt:
        def corrupt(key: ChunkKey) -> None:
            path = backend.directory.chunk_path(key)
            path.write_bytes(flip_byte(path.read_bytes()))

        return corrupt

    @pytest.fixture
    def replace_with(self, backend: DiskBackend) -> ReplaceWith:
        def replace_with(key: ChunkKey, other: ChunkKey) -> None:
            backend.directory.chunk_path(key).write_bytes(backend.directory.chunk_path(other).read_bytes())

        return replace_with

    @pytest.fixture
    def plant(self, backend: DiskBackend) -> Plant:
        def plant(key: ChunkKey, frame: bytes) -> None:
            backend.directory.chunk_path(key).write_bytes(frame)

        return plant


class TestDiskConformanceLz4ODirect(TestDiskConformance):
    codec = "lz4"

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return scanned(
            create_disk_backend({"path": str(tmp_path / "tier"), "max_size": "256MiB", "o_direct": True, "fsync": False}, ctx)
        )
