"""The backend conformance suite, one mixin per clause of the contract (see the
package docstring for how to use it).

Every mixin derives from :class:`BackendFixtures`, which holds what a backend's test
class supplies: ``make_backend`` (required), and optionally ``reopen_backend``
(persistent tiers), ``make_bounded_backend`` (tiers with a byte budget of their own)
and the fixtures ``corrupt`` and ``replace_with`` that reach into the tier's storage.
A clause whose optional part is not supplied is skipped, with one exception: a tier
that stores serde frames (``stores_frames = True``, the default) must supply
``corrupt``, ``replace_with`` and ``plant``, or the integrity and seal clauses fail,
since a byte tier that cannot show a corrupt, foreign or planted frame is a miss has
not shown it is safe.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from ..backend import PINNING, ZERO_COPY, BackendContext, BackendStats, StorageBackend
from ..config import CoreConfig
from ..keys import ChunkKey, KeyNamespace
from ..memory import MemoryPool
from ..serde import Codec, FrameSeal, Lz4Codec, RawCodec, SealedCodec, SealedCodecs, encode

#: ``corrupt(key)``: damage the stored frame of ``key`` in place (flip a payload byte).
Corrupt = Callable[[ChunkKey], None]
#: ``replace_with(key, other_key)``: store ``other_key``'s frame, byte for byte, where
#: the tier keeps ``key``'s (as a shared store written by another model would).
ReplaceWith = Callable[[ChunkKey, ChunkKey], None]
#: ``plant(key, frame)``: store ``frame`` (bytes) where the tier keeps ``key``'s
#: frame, bypassing the tier (as another client of a shared store could).
Plant = Callable[[ChunkKey, bytes], None]

#: the frame secret the seal clauses give the tier (``ctx`` parametrized with it)
FRAME_SECRET = "conformance-frame-secret-0123456789"
#: a secret of some other deployment
OTHER_FRAME_SECRET = "another-deployment's-frame-secret"

#: the chunk the pressure clauses write: 8 KiB of float16
PRESSURE_SHAPE = (16, 256)
PRESSURE_CHUNK_BYTES = 16 * 256 * 2
#: the byte budget ``make_bounded_backend`` is asked for: about 16 such chunks
BOUNDED_BYTES = 16 * PRESSURE_CHUNK_BYTES
#: chunks written against that budget (three times what fits)
PRESSURE_CHUNKS = 48


def make_context(
    pool_bytes: int = 64 << 20, *, codec: str = "raw", key_path: str = "backends[0]", frame_secret: str | None = None
) -> BackendContext:
    """A context like the engine's; with ``frame_secret``, its codecs seal frames
    (what the engine hands tiers when ``frame_secret`` is configured)."""
    codecs: dict[str, Codec] = {"raw": RawCodec(), "lz4": Lz4Codec()}
    chosen: Codec = codecs[codec]
    if frame_secret is not None:
        seal = FrameSeal(frame_secret)
        codecs, chosen = SealedCodecs(codecs, seal), SealedCodec(chosen, seal)
    return BackendContext(
        key_path=key_path,
        source="test",
        config=CoreConfig(serde=codec),
        pool=MemoryPool(pool_bytes),
        codec=chosen,
        codecs=codecs,
    )


def random_key(ns: str = "conformance") -> ChunkKey:
    return KeyNamespace(model=ns).key(os.urandom(16))


def random_chunk(
    shape: tuple[int, ...] = (4, 2, 64, 32), dtype: torch.dtype = torch.float16, seed: int | None = None
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def flip_byte(frame: bytes | bytearray, at: int = -1) -> bytes:
    """``frame`` with one bit of the byte at ``at`` flipped (default: the last, in the
    payload): what a ``corrupt`` fixture writes back."""
    damaged = bytearray(frame)
    damaged[at] ^= 0x01
    return bytes(damaged)


def _delta(before: BackendStats, after: BackendStats, field: str) -> int:
    return int(getattr(after, field)) - int(getattr(before, field))


class BackendFixtures:
    """What a backend's test class supplies. Override :meth:`make_backend`; set
    ``persistent = True`` if a second instance over the same storage sees the data
    (then :meth:`reopen_backend` must build that second instance); set
    ``stores_frames = False`` for a tier that keeps tensors rather than serde frames."""

    persistent: bool = False
    codec: str = "raw"
    stores_frames: bool = True

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        raise NotImplementedError

    def reopen_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return self.make_backend(ctx, tmp_path)

    def make_bounded_backend(self, ctx: BackendContext, tmp_path: Path, max_bytes: int) -> Optional[StorageBackend]:
        """A fresh tier that holds at most ``max_bytes`` (its own budget, evicting past
        it); ``None`` (the default) for a tier whose capacity is a server's business."""
        return None

    @pytest.fixture
    def ctx(self, request: pytest.FixtureRequest) -> BackendContext:
        """The tier's context; a test parametrizes it indirectly with a frame secret
        to get a sealing one (the seal clauses do)."""
        return make_context(codec=self.codec, frame_secret=getattr(request, "param", None))

    @pytest.fixture
    def backend(self, ctx: BackendContext, tmp_path: Path) -> Iterator[StorageBackend]:
        b = self.make_backend(ctx, tmp_path)
        yield b
        b.close()

    @pytest.fixture
    def corrupt(self, backend: StorageBackend) -> Optional[Corrupt]:
        """Override: return ``corrupt(key)`` for ``backend``'s storage."""
        return None

    @pytest.fixture
    def replace_with(self, backend: StorageBackend) -> Optional[ReplaceWith]:
        """Override: return ``replace_with(key, other_key)`` for ``backend``'s storage."""
        return None

    @pytest.fixture
    def plant(self, backend: StorageBackend) -> Optional[Plant]:
        """Override: return ``plant(key, frame)`` for ``backend``'s storage."""
        return None

    def _storage_hook(self, hook: Any, name: str) -> Any:
        if hook is not None:
            return hook
        if self.stores_frames:
            pytest.fail(
                f"{type(self).__name__}: supply the `{name}` fixture (it reaches the tier's storage) so the "
                "suite can show that a damaged or foreign frame is a miss; a tier that keeps tensors, not "
                "serde frames, sets stores_frames = False"
            )
        pytest.skip("the tier stores no frames")


class RoundTripTests(BackendFixtures):
    """put then get returns the same bytes; a miss, a wrong shape or dtype is False."""

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
        key = random_key()
        assert backend.put(key, data)
        out = torch.empty_like(data)
        assert backend.get(key, out)
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))

    def test_miss(self, backend: StorageBackend) -> None:
        out = torch.zeros(4, 2, 64, 32, dtype=torch.float16)
        assert backend.get(random_key(), out) is False

    def test_put_existing_key_is_idempotent(self, backend: StorageBackend) -> None:
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert backend.put(key, data)
        assert backend.put(key, data)
        out = torch.empty_like(data)
        assert backend.get(key, out) and torch.equal(out, data)

    def test_get_with_wrong_shape_is_a_miss(self, backend: StorageBackend) -> None:
        key, data = random_key(), random_chunk(shape=(8, 8))
        backend.put(key, data)
        assert backend.get(key, torch.empty(4, 8, dtype=torch.float16)) is False
        assert backend.get(key, torch.empty(8, 8, dtype=torch.float32)) is False


class IndexTests(BackendFixtures):
    """contains is a prefix count, remove removes, namespaces never collide."""

    def test_contains_is_prefix_count(self, backend: StorageBackend) -> None:
        keys = [random_key() for _ in range(6)]
        for k in keys[:3] + keys[4:]:
            assert backend.put(k, random_chunk(shape=(2, 16)))
        assert backend.contains(keys) == 3
        assert backend.contains(keys[4:]) == 2
        assert backend.contains([]) == 0
        assert backend.contains([random_key()] + keys) == 0

    def test_remove(self, backend: StorageBackend) -> None:
        key = random_key()
        backend.put(key, random_chunk(shape=(8, 8)))
        assert backend.remove(key) is True
        assert backend.contains([key]) == 0
        assert backend.get(key, torch.empty(8, 8, dtype=torch.float16)) is False
        assert backend.remove(key) is False

    def test_keys_do_not_collide_across_namespaces(self, backend: StorageBackend) -> None:
        h = os.urandom(16)
        a, b = KeyNamespace(model="a").key(h), KeyNamespace(model="b").key(h)
        backend.put(a, random_chunk(shape=(4, 4)))
        assert backend.contains([b]) == 0
        assert backend.get(b, torch.empty(4, 4, dtype=torch.float16)) is False


class IntegrityTests(BackendFixtures):
    """A damaged frame, or another key's valid frame in this key's place, is a miss
    (counted as one), never another key's data: the tier decodes with ``expect_key``."""

    def test_corrupt_frame_is_a_miss(self, backend: StorageBackend, corrupt: Optional[Corrupt]) -> None:
        damage = self._storage_hook(corrupt, "corrupt")
        key, data = random_key(), random_chunk(shape=(16, 64), seed=11)
        assert backend.put(key, data)
        out = torch.empty_like(data)
        assert backend.get(key, out) and torch.equal(out, data)  # negative control: intact, it hits
        damage(key)
        before = backend.stats()
        assert backend.get(key, torch.empty_like(data)) is False, "a corrupt frame was served"
        after = backend.stats()
        assert _delta(before, after, "hits") == 0
        assert _delta(before, after, "misses") == 1, "a corrupt frame must count as one miss"

    def test_foreign_frame_is_a_miss(self, backend: StorageBackend, replace_with: Optional[ReplaceWith]) -> None:
        replace = self._storage_hook(replace_with, "replace_with")
        # The same chunk hash under another namespace (another model sharing the store):
        # only the key inside the frame tells them apart.
        key = random_key("mine")
        other = KeyNamespace(model="theirs").key(key.chunk_hash)
        data, theirs = random_chunk(shape=(16, 64), seed=21), random_chunk(shape=(16, 64), seed=22)
        assert backend.put(key, data) and backend.put(other, theirs)
        replace(key, other)
        out = torch.zeros_like(data)
        before = backend.stats()
        hit = backend.get(key, out)
        assert not (hit and torch.equal(out, theirs)), (
            "served another key's frame: decode with expect_key=key so a frame of another key is a miss"
        )
        assert hit is False
        assert _delta(before, backend.stats(), "misses") == 1
        out2 = torch.empty_like(theirs)
        assert backend.get(other, out2) and torch.equal(out2, theirs)  # the frame itself is valid


class SealTests(BackendFixtures):
    """With a frame secret (``ctx`` built with :data:`FRAME_SECRET`), a tier serves
    only frames sealed with it: a frame planted in its storage by someone without the
    secret is a miss, counted as one, whether it carries a valid plain checksum or is
    sealed with another deployment's secret; the tier's own frames round-trip. A tier
    passes by handing ``ctx.codec`` / ``ctx.codecs`` to serde (or ``seal=ctx.seal``
    to serde's pieces)."""

    @pytest.mark.parametrize("ctx", [FRAME_SECRET], indirect=True)
    def test_planted_frames_are_misses(self, ctx: BackendContext, backend: StorageBackend, plant: Optional[Plant]) -> None:
        put_raw = self._storage_hook(plant, "plant")
        assert ctx.seal is not None
        key, data = random_key(), random_chunk(shape=(16, 64), seed=31)
        fake = torch.full_like(data, 666.0)
        assert backend.put(key, data)
        out = torch.empty_like(data)
        assert backend.get(key, out) and torch.equal(out, data), "a frame the tier sealed itself must round-trip"
        planted = {
            "unsealed, with a valid checksum": encode(key, fake, RawCodec()),
            "sealed with another secret": encode(key, fake, RawCodec(), seal=FrameSeal(OTHER_FRAME_SECRET)),
        }
        for label, frame in planted.items():
            put_raw(key, frame)
            before = backend.stats()
            hit = backend.get(key, torch.zeros_like(data))
            assert hit is False, f"a planted frame ({label}) was served as a hit"
            assert _delta(before, backend.stats(), "misses") == 1, f"a planted frame ({label}) must count as one miss"
        # positive control: what `plant` writes is what the tier reads
        put_raw(key, encode(key, fake, ctx.codec))
        out = torch.zeros_like(data)
        assert backend.get(key, out) and torch.equal(out, fake), "plant() does not reach the tier's storage"

    @pytest.mark.parametrize("ctx", [FRAME_SECRET], indirect=True)
    def test_planted_frame_in_a_batch_is_a_miss_for_its_key(
        self, ctx: BackendContext, backend: StorageBackend, plant: Optional[Plant]
    ) -> None:
        put_raw = self._storage_hook(plant, "plant")
        keys = [random_key("sealed-batch") for _ in range(3)]
        chunks = [random_chunk(shape=(16, 64), seed=70 + i) for i in range(3)]
        assert backend.put_many(list(zip(keys, chunks))) == [True] * 3
        put_raw(keys[1], encode(keys[1], torch.full_like(chunks[1], 666.0), RawCodec()))
        outs = [torch.zeros_like(c) for c in chunks]
        assert backend.get_many(keys, outs) == [True, False, True]
        assert torch.equal(outs[0], chunks[0]) and torch.equal(outs[2], chunks[2])


class BatchTests(BackendFixtures):
    """``get_many``/``put_many``: one result per key, each key's independent of the
    others (a miss, a corrupt or another key's frame in the middle of a batch is a
    miss for that key only), the outputs of hits filled; ``BATCHED`` is a promise about
    cost, not behaviour, so every tier passes these."""

    def test_put_many_then_get_many_round_trip(self, backend: StorageBackend) -> None:
        keys = [random_key() for _ in range(6)]
        chunks = [random_chunk(shape=(16, 64), seed=40 + i) for i in range(6)]
        assert backend.put_many(list(zip(keys, chunks))) == [True] * 6
        outs = [torch.zeros_like(c) for c in chunks]
        assert backend.get_many(keys, outs) == [True] * 6
        for o, c in zip(outs, chunks):
            assert torch.equal(o, c)
        with pytest.raises(ValueError):
            backend.get_many(keys, outs[:-1])

    def test_get_many_judges_each_key_alone(
        self, backend: StorageBackend, corrupt: Optional[Corrupt], replace_with: Optional[ReplaceWith]
    ) -> None:
        keys = [random_key("batch") for _ in range(7)]
        chunks = [random_chunk(shape=(16, 64), seed=60 + i) for i in range(7)]
        for i in (0, 1, 3, 4, 5, 6):  # 2 is never stored
            assert backend.put(keys[i], chunks[i])
        bad = {2}
        if corrupt is not None or replace_with is not None or self.stores_frames:
            damage = self._storage_hook(corrupt, "corrupt")
            replace = self._storage_hook(replace_with, "replace_with")
            damage(keys[4])  # a corrupt frame in the middle
            other = KeyNamespace(model="someone-else").key(keys[5].chunk_hash)
            assert backend.put(other, random_chunk(shape=(16, 64), seed=99))
            replace(keys[5], other)  # another key's valid frame in this key's place
            bad |= {4, 5}
        outs = [torch.zeros_like(c) for c in chunks]
        outs[6] = torch.zeros(8, 64, dtype=torch.float16)  # the caller asks for another shape
        bad.add(6)
        got = backend.get_many(keys, outs)
        assert got == [i not in bad for i in range(7)], got
        for i in range(7):
            if i not in bad:
                assert torch.equal(outs[i], chunks[i]), f"chunk {i} served with wrong bytes"


class StatsTests(BackendFixtures):
    """``stats()`` counts what happened: puts and their bytes, hits and their bytes,
    misses, chunks held (where the tier knows them)."""

    def test_stats_count_what_happened(self, backend: StorageBackend) -> None:
        items = [(random_key(), random_chunk(shape=(8, 64), seed=30 + i)) for i in range(3)]
        nbytes = items[0][1].nbytes
        before = backend.stats()
        for k, d in items:
            assert backend.put(k, d)
        for k, d in items[:2]:
            out = torch.empty_like(d)
            assert backend.get(k, out) and torch.equal(out, d)
        assert backend.get(random_key(), torch.empty(8, 64, dtype=torch.float16)) is False
        after = backend.stats()
        assert isinstance(after, BackendStats) and after.name == backend.name
        counted = {
            f: _delta(before, after, f) for f in ("puts", "put_bytes", "hits", "get_bytes", "misses", "errors", "evictions")
        }
        assert counted == {
            "puts": 3,
            "put_bytes": 3 * nbytes,  # the chunks' bytes, whatever the frame or codec
            "hits": 2,
            "get_bytes": 2 * nbytes,
            "misses": 1,
            "errors": 0,
            "evictions": 0,
        }
        if before.chunks or after.chunks:  # 0 throughout: the tier does not count chunks
            assert _delta(before, after, "chunks") == 3
        if before.bytes_used or after.bytes_used:
            assert _delta(before, after, "bytes_used") > 0


class ConcurrencyTests(BackendFixtures):
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


class LifecycleTests(BackendFixtures):
    """close is idempotent; a persistent tier's data survives a reopen."""

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


def _pressure(b: StorageBackend, start: int = 0) -> list[tuple[ChunkKey, torch.Tensor]]:
    items = [(random_key(), random_chunk(PRESSURE_SHAPE, seed=1000 + start + i)) for i in range(PRESSURE_CHUNKS)]
    for k, d in items:
        b.put(k, d)
    return items


class EvictionTests(BackendFixtures):
    """A tier with a byte budget of its own holds at most that budget under pressure,
    serves what it holds intact, and its stats add up: puts - evictions = chunks held."""

    def test_budget_holds_under_pressure(self, ctx: BackendContext, tmp_path: Path) -> None:
        b = self.make_bounded_backend(ctx, tmp_path, BOUNDED_BYTES)
        if b is None:
            pytest.skip("no byte budget of its own (make_bounded_backend returns None)")
        try:
            items = _pressure(b)
            s = b.stats()
            held = [(k, d) for k, d in items if b.contains([k]) == 1]
            assert 0 < len(held) <= BOUNDED_BYTES // PRESSURE_CHUNK_BYTES
            assert s.evictions > 0, "three times the budget was written and nothing was evicted"
            assert s.bytes_used <= BOUNDED_BYTES
            assert s.puts - s.evictions == len(held), (s.puts, s.evictions, len(held))
            assert s.chunks in (0, len(held))
            out = torch.empty(PRESSURE_SHAPE, dtype=torch.float16)
            for k, d in held:
                assert b.get(k, out) and torch.equal(out, d)
        finally:
            b.close()


class PinningTests(BackendFixtures):
    """A tier with ``PINNING``: a pinned chunk survives eviction pressure that evicts
    its unpinned twin (written at the same moment)."""

    def test_pinned_chunks_survive_eviction_pressure(self, ctx: BackendContext, tmp_path: Path) -> None:
        b = self.make_bounded_backend(ctx, tmp_path, BOUNDED_BYTES)
        if b is None:
            probe = self.make_backend(ctx, tmp_path)
            pinning = PINNING in probe.capabilities
            probe.close()
            if pinning:
                pytest.fail(f"{type(self).__name__}: a PINNING tier must supply make_bounded_backend to show pins hold")
            pytest.skip("no pinning capability")
        try:
            if PINNING not in b.capabilities:
                pytest.skip("no pinning capability")
            pinned, twin = random_key(), random_key()
            data = random_chunk(PRESSURE_SHAPE, seed=1)
            assert b.put(pinned, data) and b.put(twin, random_chunk(PRESSURE_SHAPE, seed=2))
            b.pin([pinned])
            _pressure(b)
            assert b.stats().evictions > 0
            assert b.contains([twin]) == 0, "the unpinned twin survived: no real pressure was applied"
            out = torch.empty_like(data)
            assert b.contains([pinned]) == 1 and b.get(pinned, out) and torch.equal(out, data)
            b.unpin([pinned])
        finally:
            b.close()


class ZeroCopyTests(BackendFixtures):
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


class BackendConformance(
    RoundTripTests,
    IndexTests,
    IntegrityTests,
    SealTests,
    BatchTests,
    StatsTests,
    ConcurrencyTests,
    LifecycleTests,
    EvictionTests,
    PinningTests,
    ZeroCopyTests,
):
    """Every clause. Subclass it and supply the fixtures (:class:`BackendFixtures`)."""
