"""The mooncake tier runs the backend conformance suite against a real Mooncake Store
(``mooncake_master`` and a segment owner from the wheel, on loopback) with raw frames
(lz4 frames take the staged put path: covered below, the suite's time is kept for
the rest); ``persistent``: a second client of the same store sees the data.

Closing a Mooncake client takes about a second (its threads wind down), so the
per-test ``backend`` fixture shares one tier per class; ``make_backend`` still builds
a fresh one where the suite asks for it (close, persistence)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mooncake_server import MooncakeMaster, mooncake_store  # noqa: E402,F401 - fixture

from lmcache_backend_mooncake import create_mooncake_backend  # noqa: E402
from lmcache_core.backend import BackendContext, StorageBackend  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402
from lmcache_core.testing import BackendConformance, Corrupt, Plant, ReplaceWith, flip_byte  # noqa: E402


@pytest.fixture(scope="module")
def raw_store(mooncake_store: MooncakeMaster) -> Iterator[Any]:
    """A second, plain Mooncake client: what the storage fixtures rewrite objects with."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", mooncake_store.metadata, 0, 16 << 20, "tcp", "", mooncake_store.master) == 0
    yield s
    s.close()


class TestMooncakeConformance(BackendConformance):
    persistent = True

    @pytest.fixture(autouse=True)
    def _store(self, mooncake_store: MooncakeMaster) -> None:
        self.store = mooncake_store

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_mooncake_backend(self.store.options(key_prefix=f"conf/{tmp_path.name}/", staging_size="16MiB"), ctx)

    def _rewrite(self, raw: Any, name: str, frame: bytes, *, present: bool = True) -> None:
        removed = list(raw.batch_remove([name], True))  # forced: a read a moment ago holds a lease
        assert removed == [0] or not present, removed
        assert raw.put(name, frame) == 0

    @pytest.fixture
    def corrupt(self, backend: Any, raw_store: Any) -> Corrupt:
        def corrupt(key: ChunkKey) -> None:
            name = backend._name(key)
            self._rewrite(raw_store, name, flip_byte(raw_store.get(name)))

        return corrupt

    @pytest.fixture
    def replace_with(self, backend: Any, raw_store: Any) -> ReplaceWith:
        def replace_with(key: ChunkKey, other: ChunkKey) -> None:
            self._rewrite(raw_store, backend._name(key), raw_store.get(backend._name(other)))

        return replace_with

    @pytest.fixture
    def plant(self, backend: Any, raw_store: Any) -> Plant:
        def plant(key: ChunkKey, frame: bytes) -> None:
            self._rewrite(raw_store, backend._name(key), frame, present=False)

        return plant

    @pytest.fixture(scope="class")
    @classmethod
    def _shared(cls, mooncake_store: MooncakeMaster) -> Iterator[dict[str, Any]]:
        holder: dict[str, Any] = {}
        yield holder
        for b in holder.values():
            b.close()

    @pytest.fixture
    def backend(self, ctx: BackendContext, tmp_path: Path, _shared: dict[str, Any]) -> Any:
        name = "backend" if ctx.seal is None else "sealed"  # the seal clauses get a tier of their own
        if name not in _shared:
            _shared[name] = self.make_backend(ctx, tmp_path)
        yield _shared[name]


def test_pool_chunks_are_put_in_place_and_staging_drains(mooncake_store: MooncakeMaster) -> None:
    """A raw-codec chunk in the engine's (registered) pool is sent from where it lies;
    an lz4 frame is staged. Gets land in staging and every slot comes back."""
    import torch

    from lmcache_core.testing import make_context, random_chunk, random_key

    for codec, in_place in (("raw", True), ("lz4", False)):
        ctx = make_context(codec=codec)
        b = create_mooncake_backend(mooncake_store.options(key_prefix=f"zc-{codec}/", staging_size="8MiB"), ctx)
        try:
            buf = ctx.pool.allocate((4, 2, 64, 32), torch.float16)
            assert buf is not None
            buf.tensor.copy_(random_chunk())
            keys = [random_key() for _ in range(3)]
            assert b.put_batch([(k, buf.tensor) for k in keys]) == [True] * 3
            outs = [torch.empty_like(buf.tensor) for _ in keys]
            assert b.get_batch(keys, outs) == [True] * 3
            assert all(torch.equal(o, buf.tensor) for o in outs)
            s = b.stats().extra
            assert (s["zero_copy_puts"], s["copied_puts"]) == ((3, 0) if in_place else (0, 3))
            assert s["staging_used"] == 0 and s["quarantined_bytes"] == 0
            buf.release()
        finally:
            b.close()


def test_the_tier_keeps_the_pool_it_registered_alive(mooncake_store: MooncakeMaster) -> None:
    """The pool's memory is registered with the client, so the tier holds the pool for
    as long as it lives, even when nothing else does (a context built for the call).
    It did not: a later client's own buffer, allocated where the freed pool had been,
    failed setup with "does not support overlapped memory region" (CI, 2026-11-27)."""
    import gc
    import weakref

    from lmcache_backend_mooncake.factory import pool_region
    from lmcache_core.testing import make_context

    def mapped(base: int) -> bool:
        with open("/proc/self/maps") as maps:
            spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
        return any(lo <= base < hi for lo, hi in spans)

    ctx = make_context()
    pool = weakref.ref(ctx.pool)
    region = pool_region(ctx.pool)
    assert region is not None
    b = create_mooncake_backend(mooncake_store.options(key_prefix="keep/", staging_size="8MiB"), ctx)
    del ctx
    gc.collect()
    try:
        assert pool() is not None and mapped(region[0])
        assert b._regions[-1] == region
    finally:
        b.close()
    del b
    gc.collect()
    assert pool() is None  # control: the tier was what held it
