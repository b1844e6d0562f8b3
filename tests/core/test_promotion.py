"""Promotion: a chunk read from a slower tier is promoted to the faster tiers as read,
whatever tier 0 holds under the same key. When tier 0 holds the key with another
shape, the caller gets the slower tier's chunk, tier 1 receives exactly that tensor
(never tier 0's, already released, buffer), and the pool's bytes in use return to
what tier 0 holds (no leaked or doubly released buffer); through ``retrieve_hashes``
and through ``retrieve_buffer``.

Three real tiers: the CPU tier and two reference in-memory tiers; tier 0 holds the key
as a float16 [4, 8] chunk of sevens, tier 2 the [2, 8] chunk the caller asks for.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.config import load_config
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.plugins import PluginManager
from lmcache_core.testing import MemoryTier

from .helpers import TierPlugin

NS = KeyNamespace(model="promotion-test")
WANT = (2, 8)
STALE = (4, 8)


@pytest.fixture
def three_tiers() -> Iterator[tuple[CacheEngine, LocalCpuBackend, MemoryTier, MemoryTier]]:
    plugin = TierPlugin()
    pm = PluginManager(load_entry_points=False)
    pm.register(plugin, name="promotion-tiers")
    backends = [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}, {"name": "dict_tier"}]
    with CacheEngine(load_config(env={}, overrides={"chunk_size": 16, "backends": backends}), namespace=NS, plugins=pm) as eng:
        tier0, mid, slow = eng.tiers
        assert isinstance(tier0, LocalCpuBackend) and isinstance(mid, MemoryTier) and isinstance(slow, MemoryTier)
        yield eng, tier0, mid, slow


def _setup(eng: CacheEngine, tier0: LocalCpuBackend, slow: MemoryTier, seed: int) -> tuple[bytes, torch.Tensor]:
    h = bytes([seed]) * 16
    key = eng.keys([h])[0]
    assert tier0.put(key, torch.full(STALE, 7, dtype=torch.float16))
    good = torch.randn(WANT, generator=torch.Generator().manual_seed(seed)).to(torch.float16)
    slow.plant(key, good.clone())
    return h, good


def test_retrieve_promotes_the_slow_tiers_chunk_not_tier0s(three_tiers) -> None:  # type: ignore[no-untyped-def]
    eng, tier0, mid, slow = three_tiers
    h, good = _setup(eng, tier0, slow, 1)
    used_before = eng.pool.used
    out = torch.empty(WANT, dtype=torch.float16)
    assert eng.retrieve_hashes([h], [out]) == 1
    assert torch.equal(out, good)
    assert eng.flush(10)
    promoted = mid.data[eng.keys([h])[0]]
    assert promoted.shape == WANT and torch.equal(promoted, good)  # not the [4, 8] sevens
    assert eng.pool.used == used_before  # write-behind buffer returned; tier 0's entry intact
    buf = tier0.get_buffer(eng.keys([h])[0])
    assert buf is not None and buf.tensor.shape == STALE and bool((buf.tensor == 7).all())
    buf.release()


def test_retrieve_buffer_promotes_the_slow_tiers_chunk(three_tiers) -> None:  # type: ignore[no-untyped-def]
    eng, tier0, mid, slow = three_tiers
    h, good = _setup(eng, tier0, slow, 2)
    used_before = eng.pool.used
    buf = eng.retrieve_buffer(h, WANT, torch.float16)
    assert buf is not None and torch.equal(buf.tensor, good)
    buf.release()
    assert eng.flush(10)
    promoted = mid.data[eng.keys([h])[0]]
    assert promoted.shape == WANT and torch.equal(promoted, good)
    assert eng.pool.used == used_before
