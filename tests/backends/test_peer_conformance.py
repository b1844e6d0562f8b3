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
from lmcache_core.testing import BackendConformance

SECRET = b"conformance-secret-0123456789"


class TestPeerLocalStore(BackendConformance):
    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_peer_backend({"listen": "127.0.0.1:0", "secret": SECRET.decode(), "max_size": "64MiB"}, ctx)


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
            {"peers": [f"{host}:{port}"], "secret": SECRET.decode(), "max_size": 0, "push": True, "timeout_ms": 5000},
            ctx,
        )

    def test_data_lives_on_the_node(self, backend: StorageBackend) -> None:
        from lmcache_core.testing import random_chunk, random_key

        key = random_key()
        assert backend.put(key, random_chunk(shape=(8, 8)))
        assert len(backend.store) == 0  # type: ignore[attr-defined]
        assert self._node.source.contains([key]) == 1
