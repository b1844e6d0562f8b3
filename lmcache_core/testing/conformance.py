"""The backend conformance suite (see the package docstring)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ..backend import PINNING, ZERO_COPY, BackendContext, BackendStats, StorageBackend
from ..config import CoreConfig
from ..keys import ChunkKey, KeyNamespace
from ..memory import MemoryPool
from ..serde import Lz4Codec, RawCodec


def make_context(pool_bytes: int = 64 << 20, *, codec: str = "raw", key_path: str = "backends[0]") -> BackendContext:
    codecs = {"raw": RawCodec(), "lz4": Lz4Codec()}
    return BackendContext(
        key_path=key_path,
        source="test",
        config=CoreConfig(serde=codec),
        pool=MemoryPool(pool_bytes),
        codec=codecs[codec],
        codecs=codecs,
    )


def random_key(ns: str = "conformance") -> ChunkKey:
    return KeyNamespace(model=ns).key(os.urandom(16))


def random_chunk(shape: tuple[int, ...] = (4, 2, 64, 32), dtype: torch.dtype = torch.float16, seed: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


class BackendConformance:
    """Contract tests every backend passes. Override :meth:`make_backend`; set
    ``persistent = True`` if a second instance over the same storage sees the data
    (then :meth:`reopen_backend` must build that second instance)."""

    persistent: bool = False
    codec: str = "raw"

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        raise NotImplementedError

    def reopen_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return self.make_backend(ctx, tmp_path)

    @pytest.fixture
    def ctx(self) -> BackendContext:
        return make_context(codec=self.codec)

    @pytest.fixture
    def backend(self, ctx: BackendContext, tmp_path: Path) -> Any:
        b = self.make_backend(ctx, tmp_path)
        yield b
        b.close()

    def _roundtrip(self, backend: StorageBackend, data: torch.Tensor) -> None:
        key = random_key()
        assert backend.put(key, data)
        out = torch.empty_like(data)
        assert backend.get(key, out)
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))

    def test_is_backend(self, backend: StorageBackend) -> None:
        assert isinstance(backend, StorageBackend)
        assert isinstance(backend.name, str) and backend.name
        assert isinstance(backend.capabilities, frozenset)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
    def test_put_get_roundtrip(self, backend: StorageBackend, dtype: torch.dtype) -> None:
        if dtype == torch.uint8:
            data = torch.randint(0, 256, (3, 1000), dtype=torch.uint8)
        else:
            data = random_chunk(dtype=dtype)
        self._roundtrip(backend, data)

    def test_miss(self, backend: StorageBackend) -> None:
        out = torch.zeros(4, 2, 64, 32, dtype=torch.float16)
        assert backend.get(random_key(), out) is False

    def test_contains_is_prefix_count(self, backend: StorageBackend) -> None:
        keys = [random_key() for _ in range(6)]
        for k in keys[:3] + keys[4:]:
            assert backend.put(k, random_chunk(shape=(2, 16)))
        assert backend.contains(keys) == 3
        assert backend.contains(keys[4:]) == 2
        assert backend.contains([]) == 0
        assert backend.contains([random_key()] + keys) == 0

    def test_put_existing_key_is_idempotent(self, backend: StorageBackend) -> None:
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert backend.put(key, data)
        assert backend.put(key, data)
        out = torch.empty_like(data)
        assert backend.get(key, out) and torch.equal(out, data)

    def test_remove(self, backend: StorageBackend) -> None:
        key = random_key()
        backend.put(key, random_chunk(shape=(8, 8)))
        assert backend.remove(key) is True
        assert backend.contains([key]) == 0
        assert backend.get(key, torch.empty(8, 8, dtype=torch.float16)) is False
        assert backend.remove(key) is False

    def test_get_with_wrong_shape_is_a_miss(self, backend: StorageBackend) -> None:
        key, data = random_key(), random_chunk(shape=(8, 8))
        backend.put(key, data)
        assert backend.get(key, torch.empty(4, 8, dtype=torch.float16)) is False
        assert backend.get(key, torch.empty(8, 8, dtype=torch.float32)) is False

    def test_keys_do_not_collide_across_namespaces(self, backend: StorageBackend) -> None:
        h = os.urandom(16)
        a, b = KeyNamespace(model="a").key(h), KeyNamespace(model="b").key(h)
        backend.put(a, random_chunk(shape=(4, 4)))
        assert backend.contains([b]) == 0

    def test_stats(self, backend: StorageBackend) -> None:
        backend.put(random_key(), random_chunk(shape=(16, 16)))
        s = backend.stats()
        assert isinstance(s, BackendStats)
        assert s.name == backend.name
        assert s.puts >= 1 or s.chunks >= 1

    def test_concurrent_puts_and_gets(self, backend: StorageBackend) -> None:
        items = [(random_key(), random_chunk(shape=(4, 256), seed=i)) for i in range(32)]
        errors: list[BaseException] = []

        def worker(part: list[tuple[ChunkKey, torch.Tensor]]) -> None:
            try:
                for k, d in part:
                    assert backend.put(k, d)
                for k, d in part:
                    out = torch.empty_like(d)
                    assert backend.get(k, out) and torch.equal(out, d)
            except BaseException as err:  # noqa: BLE001 - surfaced below
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(items[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors

    def test_close_is_idempotent(self, ctx: BackendContext, tmp_path: Path) -> None:
        b = self.make_backend(ctx, tmp_path)
        b.close()
        b.close()

    def test_persistence(self, ctx: BackendContext, tmp_path: Path) -> None:
        if not self.persistent:
            pytest.skip("backend is not persistent")
        key, data = random_key(), random_chunk()
        b = self.make_backend(ctx, tmp_path)
        assert b.put(key, data)
        b.close()
        b2 = self.reopen_backend(ctx, tmp_path)
        try:
            out = torch.empty_like(data)
            assert b2.contains([key]) == 1
            assert b2.get(key, out) and torch.equal(out, data)
        finally:
            b2.close()

    def test_zero_copy_capability(self, backend: StorageBackend, ctx: BackendContext) -> None:
        if ZERO_COPY not in backend.capabilities:
            pytest.skip("no zero-copy capability")
        key, data = random_key(), random_chunk(shape=(8, 8))
        buf = ctx.pool.allocate((8, 8), torch.float16)
        assert buf is not None
        buf.tensor.copy_(data)
        assert backend.put_buffer(key, buf)
        buf.release()
        got = backend.get_buffer(key)
        assert got is not None and torch.equal(got.tensor, data)
        got.release()

    def test_pinning_capability(self, backend: StorageBackend) -> None:
        if PINNING not in backend.capabilities:
            pytest.skip("no pinning capability")
        key = random_key()
        backend.put(key, random_chunk(shape=(8, 8)))
        backend.pin([key])
        backend.unpin([key])
        assert backend.contains([key]) == 1
