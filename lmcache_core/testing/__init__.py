"""Test helpers for backend authors, shipped inside the package.

The backend suite is one mixin per clause of the contract (round trips, index,
integrity, seal, stats, concurrency, lifecycle, eviction, pinning, zero-copy), all built
on :class:`BackendFixtures`. Subclass :class:`BackendConformance` for every clause,
or the mixins you want, and supply the fixtures; pytest runs the rest::

    import pytest
    from lmcache_core.testing import BackendConformance

    class TestMyTier(BackendConformance):
        def make_backend(self, ctx, tmp_path):
            return MyTier(...)

        def make_bounded_backend(self, ctx, tmp_path, max_bytes):  # optional
            return MyTier(..., max_size=max_bytes)

        @pytest.fixture
        def corrupt(self, backend):                # required for a tier storing frames
            return lambda key: flip_a_byte_of(backend, key)

        @pytest.fixture
        def replace_with(self, backend):           # required for a tier storing frames
            return lambda key, other: copy_frame(backend, src=other, dst=key)

        @pytest.fixture
        def plant(self, backend):                  # required for a tier storing frames
            return lambda key, frame: write_raw_bytes(backend, key, frame)

A test or benchmark that needs a tier of its own uses the in-memory reference tier,
:class:`~lmcache_core.testing.memory.MemoryTier` (registered for an engine by
:class:`~lmcache_core.testing.memory.MemoryTierPlugin`), rather than writing one.

Eviction policies have their own suite, :class:`EvictionPolicyConformance`
(implement ``make_policy(capacity)``). :mod:`lmcache_core.testing.tokens` drives a
:class:`~lmcache_core.engine.CacheEngine` by token ids (store, look up, retrieve a
token sequence), for tests and benchmarks.
"""

from .conformance import (
    BOUNDED_BYTES,
    FRAME_SECRET,
    PRESSURE_CHUNK_BYTES,
    BackendConformance,
    BackendFixtures,
    BatchTests,
    ConcurrencyTests,
    Corrupt,
    EvictionTests,
    IndexTests,
    IntegrityTests,
    LifecycleTests,
    PinningTests,
    Plant,
    ReplaceWith,
    RoundTripTests,
    SealTests,
    StatsTests,
    ZeroCopyTests,
    flip_byte,
    make_context,
    random_chunk,
    random_key,
)
from .clock import ManualClock
from .memory import MemoryTier, MemoryTierConfig, MemoryTierPlugin
from .policies import EvictionPolicyConformance

__all__ = [
    "BOUNDED_BYTES",
    "FRAME_SECRET",
    "PRESSURE_CHUNK_BYTES",
    "BackendConformance",
    "BackendFixtures",
    "BatchTests",
    "ConcurrencyTests",
    "Corrupt",
    "EvictionPolicyConformance",
    "EvictionTests",
    "IndexTests",
    "IntegrityTests",
    "ManualClock",
    "LifecycleTests",
    "MemoryTier",
    "MemoryTierConfig",
    "MemoryTierPlugin",
    "PinningTests",
    "Plant",
    "ReplaceWith",
    "RoundTripTests",
    "SealTests",
    "StatsTests",
    "ZeroCopyTests",
    "flip_byte",
    "make_context",
    "random_chunk",
    "random_key",
]
