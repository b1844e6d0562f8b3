"""How a backend author runs lmcache-core's conformance suite: subclass it and
supply the fixtures that reach the backend's storage."""

from pathlib import Path

import pytest

from lmcache_backend_example import DictBackend
from lmcache_core.backend import BackendContext
from lmcache_core.keys import ChunkKey
from lmcache_core.testing import PRESSURE_CHUNK_BYTES, BackendConformance, Corrupt, Plant, ReplaceWith, flip_byte


class TestDictBackend(BackendConformance):
    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> DictBackend:
        return DictBackend(ctx.codec, ctx.codecs, max_entries=1000)

    def make_bounded_backend(self, ctx: BackendContext, tmp_path: Path, max_bytes: int) -> DictBackend:
        # the budget is in entries: few enough that the suite's chunks, framed, stay under max_bytes
        return DictBackend(ctx.codec, ctx.codecs, max_entries=max_bytes // (2 * PRESSURE_CHUNK_BYTES))

    @pytest.fixture
    def corrupt(self, backend: DictBackend) -> Corrupt:
        def corrupt(key: ChunkKey) -> None:
            backend._frames[key] = flip_byte(backend._frames[key])

        return corrupt

    @pytest.fixture
    def replace_with(self, backend: DictBackend) -> ReplaceWith:
        def replace_with(key: ChunkKey, other: ChunkKey) -> None:
            backend._frames[key] = backend._frames[other]

        return replace_with

    @pytest.fixture
    def plant(self, backend: DictBackend) -> Plant:
        def plant(key: ChunkKey, frame: bytes) -> None:
            backend._frames[key] = frame

        return plant
