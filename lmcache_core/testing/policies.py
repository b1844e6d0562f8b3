"""Conformance tests for eviction policies (see :mod:`lmcache_core.eviction`).

Subclass :class:`EvictionPolicyConformance` and implement ``make_policy``; the tests
drive the policy through the real CPU tier (``LocalCpuBackend``), so they check what
an operator sees: the byte budget holds, pinned chunks stay, the tier's index and
the policy agree, and (for a policy that declares ``scan_resistant = True``) a
one-off scan does not flush a hot set::

    from lmcache_core.testing import EvictionPolicyConformance

    class TestMyPolicy(EvictionPolicyConformance):
        scan_resistant = True

        def make_policy(self, capacity):
            return MyPolicy(capacity)
"""

from __future__ import annotations

import random

import pytest
import torch

from ..eviction import EvictionPolicy
from ..keys import ChunkKey
from ..local_cpu import LocalCpuBackend
from ..memory import MemoryPool
from .conformance import random_key

CHUNK_SHAPE = (16, 64)  # float16: 2 KiB
CHUNK_BYTES = 16 * 64 * 2


def _chunk() -> torch.Tensor:
    return torch.zeros(CHUNK_SHAPE, dtype=torch.float16)


class EvictionPolicyConformance:
    """Contract tests every eviction policy passes. Claims a policy may make (each
    checked when set): ``scan_resistant``, a scan of one-off chunks does not evict a
    hot set; ``loop_resistant``, a round-robin cycle larger than the tier keeps
    hitting. :func:`scan_kept` and :func:`cycle_hits` return the raw figures (a test
    suite uses them as negative controls on LRU)."""

    scan_resistant: bool = True
    loop_resistant: bool = True

    def make_policy(self, capacity: int) -> EvictionPolicy:
        raise NotImplementedError

    def make_tier(self, n_chunks: int, pool_chunks: int | None = None) -> LocalCpuBackend:
        pool = MemoryPool((pool_chunks or n_chunks + 4) * CHUNK_BYTES)
        cap = n_chunks * CHUNK_BYTES
        return LocalCpuBackend(pool, cap, self.make_policy(cap))

    def _read(self, tier: LocalCpuBackend, key: ChunkKey) -> bool:
        buf = tier.get_buffer(key)
        if buf is None:
            return False
        buf.release()
        return True

    def test_capacity_is_held_and_index_matches_policy(self) -> None:
        tier = self.make_tier(50)
        rng = random.Random(7)
        keys = [random_key() for _ in range(200)]
        for step in range(3000):
            k = keys[min(int(rng.expovariate(1 / 40)), len(keys) - 1)]
            if rng.random() < 0.05:
                tier.remove(k)
            elif not self._read(tier, k):
                tier.put(k, _chunk())
            s = tier.stats()
            assert s.bytes_used <= 50 * CHUNK_BYTES, f"step {step}: {s.bytes_used} bytes over the budget"
        assert len(tier.policy) == tier.stats().chunks, "the policy tracks other keys than the tier holds"
        assert tier.stats().hits > 0  # the skewed stream must hit something

    def test_pins_win_over_the_policy(self) -> None:
        tier = self.make_tier(10)
        keys = [random_key() for _ in range(10)]
        for k in keys:
            assert tier.put(k, _chunk())
        pinned = keys[:5]  # the oldest: first in line for every policy here
        tier.pin(pinned)
        for _ in range(40):
            tier.put(random_key(), _chunk())
            tier.stats()
        assert all(tier.contains([k]) == 1 for k in pinned)
        assert tier.stats().bytes_used <= 10 * CHUNK_BYTES
        tier.unpin(pinned)
        assert len(tier.policy) == tier.stats().chunks

    def test_fully_pinned_tier_skips_puts_in_bounded_time(self) -> None:
        tier = self.make_tier(8)
        keys = [random_key() for _ in range(8)]
        for k in keys:
            tier.put(k, _chunk())
        tier.pin(keys)
        for _ in range(20):
            assert tier.put(random_key(), _chunk()) is False
        assert all(tier.contains([k]) == 1 for k in keys)
        assert tier.evict_for(CHUNK_BYTES) == 0
        assert len(tier.policy) == 8

    def test_pool_pressure_evicts_through_the_policy(self) -> None:
        tier = self.make_tier(8, pool_chunks=8)  # the pool, not the budget, is the limit
        for _ in range(30):
            assert tier.put(random_key(), _chunk()) or tier.stats().extra.get("rejected", 0) > 0
        assert tier.stats().chunks <= 8
        assert len(tier.policy) == tier.stats().chunks

    def test_scan_does_not_flush_a_hot_set(self) -> None:
        if not self.scan_resistant:
            pytest.skip("the policy does not claim scan resistance")
        kept = scan_kept(self.make_tier(100))
        assert kept >= 18, f"a scan evicted {20 - kept} of 20 hot chunks"

    def test_cycle_larger_than_the_tier_keeps_hitting(self) -> None:
        if not self.loop_resistant:
            pytest.skip("the policy does not claim loop resistance")
        hits = cycle_hits(self.make_tier(50))
        assert hits >= 0.25 * 300, f"only {hits} hits in 3 repeat passes over 100 chunks"


def _read(tier: LocalCpuBackend, key: ChunkKey) -> bool:
    buf = tier.get_buffer(key)
    if buf is None:
        return False
    buf.release()
    return True


def scan_kept(tier: LocalCpuBackend) -> int:
    """Of 20 hot chunks read 3 times each, how many survive a scan of 400 one-off
    chunks through a 100-chunk tier."""
    hot = [random_key() for _ in range(20)]
    for k in hot:
        tier.put(k, _chunk())
    for _ in range(3):
        for k in hot:
            assert _read(tier, k)
    for _ in range(400):
        k = random_key()
        _read(tier, k)
        tier.put(k, _chunk())
    return sum(tier.contains([k]) == 1 for k in hot)


def cycle_hits(tier: LocalCpuBackend) -> int:
    """Hits in 4 round-robin passes over 100 chunks through a 50-chunk tier (read,
    store on a miss): at most 150 for an optimal policy, 0 for LRU."""
    keys = [random_key() for _ in range(100)]
    hits = 0
    for _ in range(4):
        for k in keys:
            if _read(tier, k):
                hits += 1
            else:
                tier.put(k, _chunk())
    return hits
