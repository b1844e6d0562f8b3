"""The in-memory reference tier (``lmcache_core.testing.MemoryTier``) keeps the whole
backend contract, keeping tensors or serde frames: it passes the conformance suite in
both forms. Its knobs do what tests rely on: reads wait ``get_delay_s``, writes wait
for ``put_gate``, a ``down`` tier raises from every call, a chunk past ``max_size``
evicts the least recently used (reported to the subscriber); built through the plugin
path from a ``backends:`` entry, an engine stores and reads through it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.backend import SHARED, BackendContext, EraseMatch
from lmcache_core.config import ConfigError, load_config
from lmcache_core.plugins import PluginManager
from lmcache_core.testing import BackendConformance, MemoryTier, MemoryTierPlugin, flip_byte, random_chunk, random_key
from lmcache_core.testing.tokens import retrieve_tokens, store_tokens, token_hashes


class TestMemoryTierFrames(BackendConformance):
    """With the context's codec: serde frames, sealed when the deployment is."""

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> MemoryTier:
        return MemoryTier(codec=ctx.codec, codecs=ctx.codecs)

    def make_bounded_backend(self, ctx: BackendContext, tmp_path: Path, max_bytes: int) -> MemoryTier:
        return MemoryTier(codec=ctx.codec, codecs=ctx.codecs, max_size=max_bytes)

    @pytest.fixture
    def corrupt(self, backend: MemoryTier) -> Any:
        return lambda key: backend.plant(key, flip_byte(backend.data[key]))

    @pytest.fixture
    def replace_with(self, backend: MemoryTier) -> Any:
        return lambda key, other: backend.plant(key, backend.data[other])

    @pytest.fixture
    def plant(self, backend: MemoryTier) -> Any:
        return backend.plant


class TestMemoryTierTensors(BackendConformance):
    """Without a codec: tensor copies."""

    stores_frames = False

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> MemoryTier:
        return MemoryTier()

    def make_bounded_backend(self, ctx: BackendContext, tmp_path: Path, max_bytes: int) -> MemoryTier:
        return MemoryTier(max_size=max_bytes)


def test_lru_eviction_within_the_budget_reports_each_evicted_key() -> None:
    chunk = random_chunk(shape=(8, 64), seed=1)
    tier = MemoryTier(max_size=3 * chunk.nbytes)
    reported: list[Any] = []
    tier.subscribe_evictions(reported.append)
    keys = [random_key() for _ in range(5)]
    for k in keys[:3]:
        assert tier.put(k, chunk)
    assert tier.get(keys[0], torch.empty_like(chunk))  # keys[0] is now the most recent
    for k in keys[3:]:
        assert tier.put(k, chunk)
    assert reported == [keys[1], keys[2]]
    assert [tier.contains([k]) for k in keys] == [1, 0, 0, 1, 1]
    s = tier.stats()
    assert (s.chunks, s.bytes_used, s.evictions, s.puts) == (3, 3 * chunk.nbytes, 2, 5)
    assert not tier.put(random_key(), random_chunk(shape=(8, 256), seed=2))  # larger than the whole budget
    assert tier.stats().skipped == 1


def test_reads_wait_get_delay_and_writes_wait_for_the_gate() -> None:
    gate = threading.Event()
    tier = MemoryTier(get_delay_s=0.05, put_gate=gate)
    key, chunk = random_key(), random_chunk(shape=(4, 8), seed=3)
    writer = threading.Thread(target=tier.put, args=(key, chunk))
    writer.start()
    time.sleep(0.05)
    assert tier.contains([key]) == 0  # held at the gate
    gate.set()
    writer.join(5)
    t0 = time.monotonic()
    assert tier.get(key, torch.empty_like(chunk))
    assert time.monotonic() - t0 >= 0.05


def test_a_down_tier_raises_from_every_call_until_it_is_up() -> None:
    tier = MemoryTier(down=True)
    key, chunk = random_key(), random_chunk(shape=(4, 8), seed=4)
    calls = [
        lambda: tier.contains([key]),
        lambda: tier.put(key, chunk),
        lambda: tier.get(key, torch.empty_like(chunk)),
        lambda: tier.get_many([key], [torch.empty_like(chunk)]),
        lambda: tier.put_many([(key, chunk)]),
        lambda: tier.remove(key),
        tier.stats,
        tier.close,
    ]
    for call in calls:
        with pytest.raises(ConnectionError, match="down"):
            call()
    tier.down = False
    assert tier.put(key, chunk) and tier.contains([key]) == 1


def test_erase_takes_the_matching_namespaces() -> None:
    ns_a, ns_b = KeyNamespace(model="a"), KeyNamespace(model="b")
    tier = MemoryTier()
    chunk = random_chunk(shape=(4, 8), seed=5)
    for i in range(3):
        tier.put(ns_a.key(bytes([i]) * 16), chunk)
        tier.put(ns_b.key(bytes([i]) * 16), chunk)
    only_a = EraseMatch(frozenset({ns_a.id}))
    assert tier.erase(only_a, dry_run=True) == 3 and tier.stats().chunks == 6
    assert tier.erase(only_a) == 3 and tier.stats().chunks == 3
    assert tier.erase(EraseMatch()) == 3 and tier.stats().chunks == 0


def test_a_plugin_builds_it_from_a_backends_entry_and_an_engine_reads_through_it() -> None:
    plugin = MemoryTierPlugin("mem", shared=True)
    pm = PluginManager(load_entry_points=False)
    pm.register(plugin, name="memory-tier")
    backends = [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "mem", "max_size": "64KiB", "frames": True}]
    loaded = load_config(env={}, overrides={"chunk_size": 4, "backends": backends})
    tokens = list(range(8))
    chunks = [random_chunk(shape=(2, 4, 8), seed=s) for s in (6, 7)]
    with CacheEngine(loaded, namespace=KeyNamespace(model="memory-tier"), plugins=pm) as eng:
        tier = plugin.created[0]
        assert tier.name == "mem" and tier.max_size == 64 << 10 and SHARED in tier.capabilities
        assert store_tokens(eng, tokens, chunks) == 2 and eng.flush(10)
        assert tier.stats().puts == 2 and all(isinstance(v, bytes) for v in tier.data.values())
        for k in eng.keys(token_hashes(eng, tokens)):
            assert eng.tiers[0].remove(k)  # only the reference tier holds the chunks now
        outs = [torch.zeros_like(c) for c in chunks]
        assert retrieve_tokens(eng, tokens, outs) == 2
        assert all(torch.equal(o, c) for o, c in zip(outs, chunks))
        assert tier.stats().hits == 2


def test_an_unknown_key_in_its_backends_entry_is_a_config_error() -> None:
    pm = PluginManager(load_entry_points=False)
    pm.register(MemoryTierPlugin(), name="memory-tier")
    loaded = load_config(env={}, overrides={"chunk_size": 4, "backends": [{"name": "memory", "max_sise": "1MiB"}]})
    with pytest.raises(ConfigError, match="max_sise"):
        CacheEngine(loaded, namespace=KeyNamespace(model="memory-tier"), plugins=pm)
