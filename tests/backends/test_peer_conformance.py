"""The peer tier passes the backend conformance suite, twice:

- ``TestPeerLocalStore``: a serving instance (``listen``) that keeps what is put into it;
- ``TestPeerPushToNode``: a tier that keeps nothing locally (``max_size: 0``) and
  pushes every put/remove to a real cache node on loopback, so every get, contains and
  remove in the suite crosses the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from lmcache_backend_peer import FrameStore, PeerServer, create_peer_backend
from lmcache_core.backend import BackendContext, StorageBackend
from lmcache_core.keys import ChunkKey
from lmcache_core.testing import BackendConformance, Corrupt, Plant, ReplaceWith, flip_byte

SECRET = b"conformance-secret-0123456789"


def _store_hooks(store: FrameStore) -> tuple[Corrupt, ReplaceWith, Plant]:
    """``corrupt``, ``replace_with`` and ``plant`` over the frame store that holds the chunks."""

    def rewrite(key: ChunkKey, frame: bytes) -> None:
        assert store.remove(key)
        assert store.put_frame(key, frame)

    def corrupt(key: ChunkKey) -> None:
        frame = store.get_frame(key)
        assert frame is not None
        rewrite(key, flip_byte(bytes(frame)))

    def replace_with(key: ChunkKey, other: ChunkKey) -> None:
        frame = store.get_frame(other)
        assert frame is not None
        rewrite(key, bytes(frame))

    def plant(key: ChunkKey, frame: bytes) -> None:
        store.remove(key)  # a miss a moment ago may have dropped it already
        assert store.put_frame(key, frame)

    return corrupt, replace_with, plant


class TestPeerLocalStore(BackendConformance):
    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_peer_backend({"listen": "127.0.0.1:0", "secret": SECRET.decode(), "max_size": "64MiB"}, ctx)

    def make_bounded_backend(self, ctx: BackendContext, tmp_path: Path, max_bytes: int) -> StorageBackend:
        return create_peer_backend({"listen": "127.0.0.1:0", "secret": SECRET.decode(), "max_size": max_bytes}, ctx)

    @pytest.fixture
    def corrupt(self, backend: StorageBackend) -> Corrupt:
        return _store_hooks(backend.store)[0]  # type: ignore[attr-defined]

    @pytest.fixture
    def replace_with(self, backend: StorageBackend) -> ReplaceWith:
        return _store_hooks(backend.store)[1]  # type: ignore[attr-defined]

    @pytest.fixture
    def plant(self, backend: StorageBackend) -> Plant:
        return _store_hooks(backend.store)[2]  # type: ignore[attr-defined]


class TestPeerLocalStoreLz4(TestPeerLocalStore):
    codec = "lz4"


class TestPeerPushToNode(BackendConformance):
    @pytest.fixture(autouse=True)
    def node(self) -> Iterator[PeerServer]:
        server = PeerServer(FrameStore(256 << 20), ("127.0.0.1", 0), SECRET, writable=True, timeout=5.0)
        self._node = server
        yield server
        server.close()

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        host, port = self._node.address
        return create_peer_backend(
            {"peers": [f"{host}:{port}"], "secret": SECRET.decode(), "max_size": 0, "push": True, "timeout_s": 5.0},
            ctx,
        )

    @pytest.fixture
    def corrupt(self, backend: StorageBackend) -> Corrupt:
        return _store_hooks(self._node.source)[0]  # type: ignore[arg-type]

    @pytest.fixture
    def replace_with(self, backend: StorageBackend) -> ReplaceWith:
        return _store_hooks(self._node.source)[1]  # type: ignore[arg-type]

    @pytest.fixture
    def plant(self, backend: StorageBackend) -> Plant:
        return _store_hooks(self._node.source)[2]  # type: ignore[arg-type]

    def test_data_lives_on_the_node(self, backend: StorageBackend) -> None:
        from lmcache_core.testing import random_chunk, random_key

        key = random_key()
        assert backend.put(key, random_chunk(shape=(8, 8)))
        assert len(backend.store) == 0  # type: ignore[attr-defined]
        assert self._node.source.contains([key]) == 1
