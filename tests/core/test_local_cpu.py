"""The CPU tier (``local_cpu``): the backend conformance suite; config errors naming
key path and source; the byte budget with LRU eviction (a chunk larger than the budget
is skipped); pins that survive budget and pool pressure; memory returned on remove and
close, but held while a reader still has the buffer; thread safety under concurrent
puts, gets, evictions and pins; the pinned count in stats."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from lmcache_core.backend import BackendContext
from lmcache_core.config import ConfigError
from lmcache_core.keys import ChunkKey
from lmcache_core.local_cpu import LocalCpuBackend, create_local_cpu
from lmcache_core.memory import MemoryPool
from lmcache_core.testing import BackendConformance, make_context, random_chunk, random_key

CHUNK = (16, 64)  # float16: 2 KiB, a multiple of the pool alignment
CHUNK_BYTES = 16 * 64 * 2


class TestLocalCpuConformance(BackendConformance):
    stores_frames = False  # tensors in the pool: no frame to damage or swap

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> LocalCpuBackend:
        return create_local_cpu({"max_size": "16MiB"}, ctx)

    def make_bounded_backend(self, ctx: BackendContext, tmp_path: Path, max_bytes: int) -> LocalCpuBackend:
        return create_local_cpu({"max_size": max_bytes, "eviction": "lru"}, ctx)


def make_tier(n_chunks: int, pool_chunks: int | None = None) -> LocalCpuBackend:
    pool = MemoryPool((pool_chunks or n_chunks) * CHUNK_BYTES)
    return LocalCpuBackend(pool, n_chunks * CHUNK_BYTES)


def chunk(seed: int) -> torch.Tensor:
    return random_chunk(CHUNK, seed=seed)


def present(tier: LocalCpuBackend, keys: list[ChunkKey]) -> list[bool]:
    return [tier.contains([k]) == 1 for k in keys]


def test_config_section_errors_name_key_path_and_source() -> None:
    ctx = make_context(1 << 20, key_path="backends[2]")
    with pytest.raises(ConfigError, match=r"backends\[2\]\.max_size: .*size.* \(from test\)"):
        create_local_cpu({"max_size": "big"}, ctx)
    with pytest.raises(ConfigError, match=r"backends\[2\]\.colour: unknown key"):
        create_local_cpu({"colour": "red"}, ctx)
    assert create_local_cpu({"max_size": "512KiB"}, ctx).max_size == 512 * 1024


def test_byte_budget_and_lru_order() -> None:
    tier = make_tier(4, pool_chunks=16)  # the budget, not the pool, is the limit
    keys = [random_key() for _ in range(7)]
    for i in range(4):
        assert tier.put(keys[i], chunk(i))
    assert tier.stats().bytes_used == 4 * CHUNK_BYTES
    out = torch.empty(CHUNK, dtype=torch.float16)
    assert tier.get(keys[0], out)  # touch 0: now 1 is least recently used
    assert tier.put(keys[4], chunk(4))
    assert present(tier, keys[:5]) == [True, False, True, True, True]
    assert tier.contains([keys[2]]) == 1  # contains does not refresh recency
    assert tier.put(keys[5], chunk(5))
    assert present(tier, keys[:6]) == [True, False, False, True, True, True]
    s = tier.stats()
    assert s.evictions == 2 and s.chunks == 4 and s.bytes_used <= tier.max_size
    assert tier.get(keys[0], out) and torch.equal(out, chunk(0))


def test_chunk_larger_than_budget_is_skipped() -> None:
    tier = make_tier(2, pool_chunks=8)
    assert tier.put(random_key(), random_chunk((16, 64 * 3), seed=1)) is False
    assert tier.stats().skipped == 1 and tier.stats().chunks == 0


def test_pinned_chunks_survive_budget_pressure() -> None:
    tier = make_tier(4, pool_chunks=16)
    keys = [random_key() for _ in range(4)]
    for i, k in enumerate(keys):
        tier.put(k, chunk(i))
    tier.pin(keys[:2])
    tier.pin(keys[:1])  # pinned twice: needs two unpins
    for i in range(20):
        tier.put(random_key(), chunk(100 + i))
    assert present(tier, keys) == [True, True, False, False]
    tier.unpin(keys[:2])
    for i in range(3):
        tier.put(random_key(), chunk(200 + i))
    assert present(tier, keys[:2]) == [True, False]
    tier.unpin(keys[:1])
    for i in range(4):
        tier.put(random_key(), chunk(300 + i))
    assert present(tier, keys[:1]) == [False]


def test_pinned_chunks_survive_pool_pressure_and_full_pins_skip() -> None:
    tier = make_tier(8, pool_chunks=4)  # the pool, not the budget, is the limit
    keys = [random_key() for _ in range(4)]
    for i, k in enumerate(keys):
        assert tier.put(k, chunk(i))
    tier.pin(keys)
    assert tier.put(random_key(), chunk(9)) is False  # nothing evictable: skip, no exception
    assert present(tier, keys) == [True] * 4
    out = torch.empty(CHUNK, dtype=torch.float16)
    for i, k in enumerate(keys):
        assert tier.get(k, out) and torch.equal(out, chunk(i))
    tier.unpin(keys[1:2])
    assert tier.put(random_key(), chunk(10))
    assert present(tier, keys) == [True, False, True, True]


def test_remove_and_close_return_memory() -> None:
    tier = make_tier(4)
    keys = [random_key() for _ in range(3)]
    for i, k in enumerate(keys):
        tier.put(k, chunk(i))
    assert tier.pool.used == 3 * CHUNK_BYTES
    assert tier.remove(keys[0]) and tier.pool.used == 2 * CHUNK_BYTES
    tier.close()
    assert tier.pool.used == 0 and tier.contains(keys) == 0


def test_buffer_held_by_a_reader_outlives_eviction() -> None:
    tier = make_tier(1, pool_chunks=4)
    k = random_key()
    tier.put(k, chunk(1))
    held = tier.get_buffer(k)
    assert held is not None
    tier.put(random_key(), chunk(2))  # evicts k from the tier
    assert tier.contains([k]) == 0
    assert torch.equal(held.tensor, chunk(1)), "an evicted buffer was reused while still referenced"
    held.release()


def test_thread_safety_under_puts_gets_evictions_and_pins() -> None:
    tier = make_tier(24, pool_chunks=32)
    keys = [random_key() for _ in range(64)]
    errors: list[str] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        out = torch.empty(CHUNK, dtype=torch.float16)
        for _ in range(600):
            i = rnd.randrange(len(keys))
            op = rnd.random()
            if op < 0.45:
                tier.put(keys[i], chunk(i))
            elif op < 0.85:
                if tier.get(keys[i], out) and not torch.equal(out, chunk(i)):
                    errors.append(f"wrong data for key {i}")
            elif op < 0.95:
                tier.pin([keys[i]])
                if tier.get(keys[i], out) and not torch.equal(out, chunk(i)):
                    errors.append(f"wrong data for pinned key {i}")
                tier.unpin([keys[i]])
            else:
                tier.remove(keys[i])

    def watcher() -> None:
        while not stop.is_set():
            s = tier.stats()
            if s.bytes_used > tier.max_size or tier.pool.used > tier.pool.capacity:
                errors.append(f"over budget: {s.bytes_used}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    w = threading.Thread(target=watcher)
    w.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    w.join()
    assert not errors, errors[:5]
    s = tier.stats()
    assert s.evictions > 0, "the test never evicted"
    assert s.extra["pinned"] == 0
    assert tier.pool.used == s.bytes_used == s.chunks * CHUNK_BYTES
    tier.close()
    assert tier.pool.used == 0 and tier.pool.free_regions == 1


def test_pinned_count_in_stats_follows_pins_unpins_and_removal() -> None:
    tier = make_tier(4)
    a, b, c = random_key(), random_key(), random_key()
    for i, k in enumerate((a, b, c)):
        assert tier.put(k, chunk(i))
    tier.pin([a, b])
    tier.pin([a])  # a second pin on the same chunk counts it once
    assert tier.stats().extra["pinned"] == 2
    tier.unpin([a])
    assert tier.stats().extra["pinned"] == 2  # a still holds one pin
    assert tier.remove(b)
    assert tier.stats().extra["pinned"] == 1
    tier.unpin([a, c])  # c was never pinned
    assert tier.stats().extra["pinned"] == 0
    tier.close()
