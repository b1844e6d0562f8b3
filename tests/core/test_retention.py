"""Retention hints (lmcache_core.retention) in the CPU tier: a retained chunk outlives
unretained ones, whatever the eviction policy, until its time runs out; retained
chunks never take more than the tier's retention share (the weakest are released);
a hint for a chunk still on its way applies when it arrives."""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_core.eviction import BUILTIN_POLICIES
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.memory import MemoryPool
from lmcache_core.testing import ManualClock, random_key

from .test_local_cpu import CHUNK_BYTES, chunk, present

N = 20  # chunks the tier holds


def tier(policy: str, share: float = 0.5) -> tuple[LocalCpuBackend, ManualClock]:
    t = LocalCpuBackend(MemoryPool(N * CHUNK_BYTES), N * CHUNK_BYTES, BUILTIN_POLICIES[policy][0](N * CHUNK_BYTES), share)
    clock = ManualClock()
    t.retention.clock = clock
    return t, clock


def flood(t: LocalCpuBackend, n: int, seed: int) -> None:
    """``n`` one-off chunks, each read twice (so frequency policies admit them)."""
    for i in range(n):
        k = random_key(seed * 100_000 + i)
        assert t.put(k, chunk(i))
        for _ in range(2):
            buf = t.get_buffer(k)
            if buf is not None:
                buf.release()


@pytest.mark.parametrize("policy", sorted(BUILTIN_POLICIES))
def test_retained_chunks_outlive_a_flood_until_their_time_runs_out(policy: str) -> None:
    t, clock = tier(policy)
    kept = [random_key(i) for i in range(5)]
    plain = [random_key(50 + i) for i in range(5)]
    for i, k in enumerate(kept + plain):
        assert t.put(k, chunk(i))
    assert t.retain(kept, 60.0, 1) == 5
    flood(t, 5 * N, seed=1)
    assert present(t, kept) == [True] * 5, "a retained chunk was evicted"
    assert present(t, plain) == [False] * 5  # control: the same chunks unretained are gone
    assert t.stats().extra["retention_kept"] > 0 and t.stats().extra["retained"] == 5
    clock.now += 61  # expired: ordinary chunks again, which the policy may evict
    flood(t, 5 * N, seed=2)
    assert t.stats().extra["retained"] == 0 and t.stats().extra["retained_bytes"] == 0
    if policy == "lru":  # recency alone: a flood removes them now
        assert present(t, kept) == [False] * 5


def test_retention_is_bounded_by_its_share_and_the_weakest_go_first() -> None:
    t, _ = tier("lru", share=0.25)  # 5 of 20 chunks
    low = [random_key(i) for i in range(4)]
    high = [random_key(10 + i) for i in range(4)]
    for i, k in enumerate(low + high):
        assert t.put(k, chunk(i))
    t.retain(low, 60.0, 1)
    t.retain(high, 60.0, 9)
    s = t.stats().extra
    assert s["retained"] == 5 and s["retained_bytes"] == 5 * CHUNK_BYTES and s["retention_released"] == 3
    flood(t, 5 * N, seed=3)
    assert present(t, high) == [True] * 4  # the higher priority kept
    assert sum(present(t, low)) == 1
    assert t.stats().chunks == N  # the tier still takes new chunks around the retained


def test_a_hint_for_a_chunk_on_its_way_applies_when_it_arrives() -> None:
    t, clock = tier("tinylfu")
    later = [random_key(i) for i in range(3)]
    assert t.retain(later, 100.0, 0) == 0  # not there yet: pending
    for i, k in enumerate(later):
        assert t.put(k, chunk(i))
    flood(t, 5 * N, seed=4)
    assert present(t, later) == [True] * 3
    stale = random_key(99)
    t.retain([stale], 30.0, 0)
    clock.now += 31  # expired before it arrived: not retained
    assert t.put(stale, chunk(99))
    assert t.stats().extra["retained"] == 3


def test_retention_extends_and_never_shortens(monkeypatch: Any) -> None:
    t, clock = tier("s3fifo")
    k = random_key(1)
    assert t.put(k, chunk(1))
    t.retain([k], 100.0, 0)
    t.retain([k], 10.0, 0)  # shorter: no change
    clock.now += 50
    flood(t, 5 * N, seed=5)
    assert present(t, [k]) == [True]
