"""The redis tier runs the backend conformance suite against real ``redis-server``
processes on loopback: a single server (raw and lz4 frames) and a three-master Redis
Cluster. ``persistent``: a second tier instance over the same prefix sees the data."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisCluster3, RedisServer, redis_cluster, redis_server  # noqa: E402,F401 - fixtures

from lmcache_backend_redis import create_redis_backend  # noqa: E402
from lmcache_core.backend import BackendContext, StorageBackend  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402
from lmcache_core.testing import BackendConformance, Corrupt, Plant, ReplaceWith, flip_byte  # noqa: E402


class RedisStorageFixtures(BackendConformance):
    """The storage fixtures rewrite the values through the tier's own client (a
    cluster client routes each name to its node)."""

    @pytest.fixture
    def corrupt(self, backend: Any) -> Corrupt:
        def corrupt(key: ChunkKey) -> None:
            name = backend._name(key)
            backend.client.set(name, flip_byte(backend.client.get(name)))

        return corrupt

    @pytest.fixture
    def replace_with(self, backend: Any) -> ReplaceWith:
        def replace_with(key: ChunkKey, other: ChunkKey) -> None:
            backend.client.set(backend._name(key), backend.client.get(backend._name(other)))

        return replace_with

    @pytest.fixture
    def plant(self, backend: Any) -> Plant:
        def plant(key: ChunkKey, frame: bytes) -> None:
            backend.client.set(backend._name(key), frame)

        return plant


class TestRedisConformance(RedisStorageFixtures):
    persistent = True

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_redis_backend({"url": self.server.url, "prefix": f"conf:{tmp_path.name}:"}, ctx)


class TestRedisConformanceLz4(TestRedisConformance):
    codec = "lz4"


class TestRedisClusterConformance(RedisStorageFixtures):
    persistent = True

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: RedisCluster3) -> None:
        self.cluster = redis_cluster

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_redis_backend({"cluster": self.cluster.seeds, "prefix": f"conf:{tmp_path.name}:"}, ctx)
