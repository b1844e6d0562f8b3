"""CacheEngine across tiers, by token ids: a store reaches tier 0 synchronously and
round-trips; a lookup finds the longest prefix across all tiers; a retrieve reads the
fastest tier, promotes, stops at the first missing chunk and takes a wrong shape for
a miss; a slow tier never blocks a store (a full write queue drops); pins protect
chunks between lookup and load; a failing backend means misses, not exceptions; tags
and salt separate caches; write-behind survives a CPU tier smaller than the writes
and uses the declared write concurrency; listeners see stores and evictions; an
engine without shared writes never writes the shared tiers."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest
import torch

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.config import load_config
from lmcache_core.hookspecs import hookimpl
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.plugins import PluginManager
from lmcache_core.testing import MemoryTier
from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens, token_hashes

from .helpers import TierPlugin

CS = 16
SHAPE = (2, 2, CS, 32)  # [layers, k/v, tokens, hidden], float16: 4 KiB per chunk
CHUNK_BYTES = 2 * 2 * CS * 32 * 2
NS = KeyNamespace(model="engine-test", layout="test", dtype="float16")


def data_for(tokens: list[int], i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(tuple(tokens[: (i + 1) * CS])) % 2**31)
    return torch.randn(SHAPE, generator=g).to(torch.float16)


def chunks_for(tokens: list[int]) -> list[torch.Tensor]:
    return [data_for(tokens, i) for i in range(len(tokens) // CS)]


def prompt(seed: int, n_chunks: int) -> list[int]:
    return [(seed * 1000003 + i * 7919) % 50000 for i in range(n_chunks * CS)]


def prepared(eng: CacheEngine, seed: int, n_chunks: int) -> tuple[list[int], list[torch.Tensor], list[Any]]:
    """A prompt, its chunk data and its keys in ``eng``'s namespace."""
    toks = prompt(seed, n_chunks)
    return toks, chunks_for(toks), eng.keys(token_hashes(eng, toks))


def empty_outs(n: int) -> list[torch.Tensor]:
    return [torch.empty(SHAPE, dtype=torch.float16) for _ in range(n)]


def engine(backends: list[dict[str, Any]], plugin: TierPlugin | None = None, **cfg: Any) -> CacheEngine:
    pm = PluginManager(load_entry_points=False)
    if plugin is not None:
        pm.register(plugin, name="test-tiers")
    loaded = load_config(env={}, overrides={"chunk_size": CS, "backends": backends, **cfg})
    return CacheEngine(loaded, namespace=NS, plugins=pm)


@pytest.fixture
def two_tiers() -> Iterator[tuple[CacheEngine, LocalCpuBackend, MemoryTier]]:
    plugin = TierPlugin()
    with engine([{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}], plugin) as eng:
        tier0, tier1 = eng.tiers
        assert isinstance(tier0, LocalCpuBackend) and isinstance(tier1, MemoryTier)
        yield eng, tier0, tier1


def test_registered_test_plugin_is_scoped() -> None:
    pm = PluginManager(load_entry_points=False)
    with pm.registered(TierPlugin(), name="scoped"):
        assert "dict_tier" in pm.backends()
    assert "dict_tier" not in pm.backends()


def test_store_reaches_tier0_synchronously_and_round_trips(two_tiers: Any) -> None:
    eng, tier0, tier1 = two_tiers
    toks = prompt(1, 4)
    assert store_tokens(eng, toks, chunks_for(toks)) == 4
    keys = eng.keys(token_hashes(eng, toks))
    assert tier0.contains(keys) == 4  # no flush needed for tier 0
    assert eng.flush(10)
    assert tier1.contains(keys) == 4
    assert lookup_tokens(eng, toks) == 4 * CS
    outs = empty_outs(4)
    assert retrieve_tokens(eng, toks, outs) == 4
    assert all(torch.equal(o, c) for o, c in zip(outs, chunks_for(toks)))


def test_lookup_is_longest_prefix_across_all_tiers(two_tiers: Any) -> None:
    eng, tier0, tier1 = two_tiers
    toks, data, keys = prepared(eng, 2, 6)
    for i in (0, 3):  # tier 0 has chunks 0 and 3
        tier0.put(keys[i], data[i])
    for i in (1, 2, 4):  # tier 1 has 1, 2 and 4; nobody has 5
        tier1.put(keys[i], data[i])
    assert lookup_tokens(eng, toks) == 5 * CS
    assert lookup_tokens(eng, toks + [1, 2, 3]) == 5 * CS  # a partial tail never counts
    tier1.remove(keys[2])
    assert lookup_tokens(eng, toks) == 2 * CS  # a gap in every tier ends the prefix
    assert lookup_tokens(eng, prompt(3, 6)) == 0


def test_retrieve_reads_fastest_tier_and_promotes(two_tiers: Any) -> None:
    eng, tier0, tier1 = two_tiers
    toks, data, keys = prepared(eng, 4, 3)
    tier0.put(keys[0], data[0])
    tier1.put(keys[0], torch.zeros(SHAPE, dtype=torch.float16))  # a stale copy lower down
    tier1.put(keys[1], data[1])
    tier1.put(keys[2], data[2])
    outs = empty_outs(3)
    assert retrieve_tokens(eng, toks, outs) == 3
    assert all(torch.equal(o, d) for o, d in zip(outs, data)), "chunk 0 must come from tier 0"
    assert tier0.contains(keys) == 3, "chunks read from tier 1 are promoted into tier 0"
    tier1.remove(keys[1])
    tier1.remove(keys[2])
    assert retrieve_tokens(eng, toks, outs) == 3  # now served by tier 0 alone


def test_retrieve_stops_at_first_missing_chunk(two_tiers: Any) -> None:
    eng, tier0, _ = two_tiers
    toks, data, keys = prepared(eng, 5, 3)
    tier0.put(keys[0], data[0])
    tier0.put(keys[2], data[2])
    outs = empty_outs(3)
    assert retrieve_tokens(eng, toks, outs) == 1
    assert eng.counters.load_errors == 2  # chunks not loaded (1 and 2), not calls


def test_wrong_shape_in_a_tier_is_a_miss_not_wrong_data(two_tiers: Any) -> None:
    eng, tier0, tier1 = two_tiers
    toks = prompt(6, 1)
    key = eng.keys(token_hashes(eng, toks))[0]
    tier0.put(key, torch.ones(2, 2, CS, 16, dtype=torch.float16))
    out = torch.zeros(SHAPE, dtype=torch.float16)
    assert retrieve_tokens(eng, toks, [out]) == 0


def test_slow_tier_never_blocks_store_and_flush_waits() -> None:
    gate = threading.Event()
    plugin = TierPlugin(gate)
    with engine([{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}], plugin) as eng:
        slow = plugin.created[0]
        assert isinstance(slow, MemoryTier)
        toks = prompt(7, 3)
        t = threading.Thread(target=store_tokens, args=(eng, toks, chunks_for(toks)))
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "store blocked on a slow tier"
        assert lookup_tokens(eng, toks) == 3 * CS  # served from tier 0 meanwhile
        assert eng.flush(timeout=0.2) is False  # the slow tier has not finished
        assert slow.contains(eng.keys(token_hashes(eng, toks))) == 0
        gate.set()
        assert eng.flush(timeout=10) is True
        assert slow.contains(eng.keys(token_hashes(eng, toks))) == 3


def test_full_write_queue_drops_instead_of_blocking() -> None:
    gate = threading.Event()
    plugin = TierPlugin(gate)
    with engine([{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}], plugin, write_queue_size=2) as eng:
        slow = plugin.created[0]
        toks = prompt(8, 8)
        t = threading.Thread(target=store_tokens, args=(eng, toks, chunks_for(toks)))
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "store blocked on a full write queue"
        dropped = eng.counters.dropped_writes
        # Two chunks always fit the queue, so at most 6 are dropped. How many more the
        # writer takes before its put blocks depends on thread timing: it drains what
        # is queued into one batch, and the store may queue more meanwhile (4 dropped,
        # not 5-6, on a loaded CI host). Each chunk is either written or counted dropped.
        assert 1 <= dropped <= 6
        assert lookup_tokens(eng, toks) == 8 * CS
        gate.set()
        assert eng.flush(10)
        assert len(slow.data) == 8 - dropped


def test_pins_protect_chunks_between_lookup_and_load() -> None:
    budget = f"{4 * CHUNK_BYTES}B"
    with engine([{"name": "local_cpu", "max_size": budget}]) as eng:
        tier0 = eng.tiers[0]
        a = prompt(9, 4)
        assert store_tokens(eng, a, chunks_for(a)) == 4
        assert lookup_tokens(eng, a, pin_id="req-a") == 4 * CS
        for s in range(10, 14):  # pressure: other prompts want the space
            other = prompt(s, 2)
            store_tokens(eng, other, chunks_for(other))
        assert lookup_tokens(eng, a) == 4 * CS, "a pinned chunk was evicted"
        outs = empty_outs(4)
        assert retrieve_tokens(eng, a, outs) == 4
        assert all(torch.equal(o, c) for o, c in zip(outs, chunks_for(a)))
        eng.pins.release("req-a")
        assert tier0.stats().extra["pinned"] == 0
        for s in range(20, 22):
            other = prompt(s, 2)
            store_tokens(eng, other, chunks_for(other))
        assert lookup_tokens(eng, a) < 4 * CS, "after unpin the chunks are evictable again"
        eng.pins.release("req-a")  # unpinning twice is harmless


@pytest.mark.parametrize("order", ["broken-first", "broken-last", "broken-only"])
def test_a_failing_backend_means_misses_not_exceptions(order: str) -> None:
    cpu = {"name": "local_cpu", "max_size": "1MiB"}
    backends = {
        "broken-first": [{"name": "broken"}, cpu],
        "broken-last": [cpu, {"name": "broken"}],
        "broken-only": [{"name": "broken"}],
    }[order]
    with engine(backends, TierPlugin()) as eng:
        toks = prompt(30, 3)
        stored = store_tokens(eng, toks, chunks_for(toks))
        assert eng.flush(10)
        outs = empty_outs(3)
        if order == "broken-only":
            assert stored == 0 and lookup_tokens(eng, toks) == 0 and retrieve_tokens(eng, toks, outs) == 0
        else:
            assert lookup_tokens(eng, toks) == 3 * CS
            assert retrieve_tokens(eng, toks, outs) == 3
            assert all(torch.equal(o, c) for o, c in zip(outs, chunks_for(toks)))
        assert eng.counters.backend_errors.get("broken", 0) > 0
        stats = eng.stats()
        assert any(t.get("error") for t in stats["tiers"])  # type: ignore[union-attr]


def test_tags_and_salt_separate_caches() -> None:
    with engine([{"name": "local_cpu", "max_size": "1MiB"}]) as eng:
        toks = prompt(40, 2)
        store_tokens(eng, toks, chunks_for(toks), tags={"user": "a"})
        assert lookup_tokens(eng, toks, tags={"user": "a"}) == 2 * CS
        assert lookup_tokens(eng, toks, tags={"user": "b"}) == 0
        assert lookup_tokens(eng, toks) == 0
    with engine([{"name": "local_cpu", "max_size": "1MiB"}], tenant_salt="t1") as eng:
        assert eng.namespace.salt == "t1" and eng.keys([b"\0" * 16])[0].namespace != NS.id


def test_store_with_more_chunks_than_tokens_is_an_error(two_tiers: Any) -> None:
    eng, _, _ = two_tiers
    toks = prompt(50, 2)
    with pytest.raises(ValueError, match="chunks given"):
        store_tokens(eng, toks, chunks_for(toks) + [torch.zeros(SHAPE, dtype=torch.float16)])


def test_write_behind_survives_a_cpu_tier_smaller_than_the_writes() -> None:
    """Chunks queued for a slow tier hold pool memory after the CPU tier evicted
    them; the staging headroom keeps later saves from being dropped, so every chunk
    reaches the slow tier even when the burst is 4x the CPU tier's budget."""
    gate = threading.Event()
    plugin = TierPlugin(gate)
    n = 4 * (64 * 1024 // CHUNK_BYTES)  # 4x a 64 KiB CPU tier
    with engine([{"name": "local_cpu", "max_size": "64KiB"}, {"name": "dict_tier"}], plugin, staging_size="1MiB") as eng:
        slow = plugin.created[0]
        toks = prompt(11, n)
        chunks = chunks_for(toks)
        for i in range(n):  # one chunk per call, as the connector stores them
            buf = eng.allocate(SHAPE, torch.float16)
            assert buf is not None, f"pool exhausted at chunk {i}"
            buf.tensor.copy_(chunks[i])
            assert eng.store_hashes(token_hashes(eng, toks)[i : i + 1], [buf]) == 1
            buf.release()
        assert eng.tiers[0].stats().bytes_used <= 64 * 1024
        gate.set()
        assert eng.flush(timeout=10)
        assert slow.contains(eng.keys(token_hashes(eng, toks))) == n
        outs = empty_outs(n)
        assert retrieve_tokens(eng, toks, outs) == n
        assert all(torch.equal(a, b) for a, b in zip(outs, chunks))


class _ConcurrentTier(MemoryTier):
    """Declares 4 concurrent writes; records how many puts overlap."""

    name = "concurrent_tier"
    write_concurrency = 4

    def __init__(self) -> None:
        super().__init__()
        self.active = 0
        self.max_active = 0

    def put(self, key: Any, data: torch.Tensor) -> bool:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(0.2)  # a round trip
        with self.lock:
            self.active -= 1
        return super().put(key, data)


class _ConcurrentPlugin:
    def __init__(self) -> None:
        self.created: list[_ConcurrentTier] = []

    @hookimpl
    def register_backends(self, register: Any) -> None:
        def factory(section: Any, ctx: Any) -> _ConcurrentTier:
            t = _ConcurrentTier()
            self.created.append(t)
            return t

        register("concurrent_tier", factory)


@pytest.mark.parametrize("declared", [1, 4])
def test_write_behind_uses_the_declared_write_concurrency(declared: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ConcurrentTier, "write_concurrency", declared)
    pm = PluginManager(load_entry_points=False)
    plugin = _ConcurrentPlugin()
    pm.register(plugin, name="concurrent")
    loaded = load_config(
        env={}, overrides={"chunk_size": CS, "backends": [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "concurrent_tier"}]}
    )
    with CacheEngine(loaded, namespace=NS, plugins=pm) as eng:
        toks = prompt(13, 12)
        chunks = chunks_for(toks)
        tier = plugin.created[0]
        # One chunk at a time, each once a write is in flight: a writer takes whatever
        # is queued in one put_many, so chunks stored in one burst could all go to one
        # thread on a slow machine; spaced like this, an idle writer takes the next.
        for i, chunk in enumerate(chunks):
            store_tokens(eng, toks, [chunk], start_chunk=i)
            deadline = time.monotonic() + 5
            while tier.active == 0 and tier.stats().puts <= i and time.monotonic() < deadline:
                time.sleep(0.001)
        assert eng.flush(timeout=30)
        assert tier.contains(eng.keys(token_hashes(eng, toks))) == 12
        # never more than declared; with 4 declared, puts do overlap (timing-robust bound)
        assert tier.max_active <= declared and (tier.max_active == 1 if declared == 1 else tier.max_active >= 2)


def test_listeners_see_stores_per_tier_and_evictions() -> None:
    """Every chunk that reaches a tier is reported once per tier, every chunk the CPU
    tier drops for room is reported as evicted, and nothing else is."""
    plugin = TierPlugin()
    events: list[Any] = []
    with engine(
        [{"name": "local_cpu", "max_size": f"{3 * CHUNK_BYTES}B", "eviction": "lru"}, {"name": "dict_tier"}], plugin
    ) as eng:
        eng.add_listener(events.append)
        a, b = prompt(31, 2), prompt(32, 2)
        ka, kb = eng.keys(token_hashes(eng, a)), eng.keys(token_hashes(eng, b))
        assert store_tokens(eng, a, chunks_for(a)) == 2
        assert eng.flush(10)
        assert sorted((e.kind, e.tier) for e in events) == [("stored", "dict_tier")] * 2 + [("stored", "local_cpu")] * 2
        assert {e.key for e in events} == set(ka)
        events.clear()
        assert store_tokens(eng, a, chunks_for(a)) == 0  # already cached: no event
        assert events == []
        assert store_tokens(eng, b, chunks_for(b)) == 2  # 4 chunks in a 3-chunk tier: a[0] goes (LRU)
        assert eng.flush(10)
        evicted = [e for e in events if e.kind == "evicted"]
        assert [(e.tier, e.key) for e in evicted] == [("local_cpu", ka[0])]
        assert lookup_tokens(eng, a) == 2 * CS  # still in the slower tier
        stored = sorted((e.tier, str(e.key)) for e in events if e.kind == "stored")
        assert stored == sorted([("local_cpu", str(k)) for k in kb] + [("dict_tier", str(k)) for k in kb])


def test_a_failing_listener_never_breaks_a_store() -> None:
    def boom(event: Any) -> None:
        raise RuntimeError("listener bug")

    with engine([{"name": "local_cpu", "max_size": f"{1 * CHUNK_BYTES}B"}]) as eng:
        eng.add_listener(boom)
        a = prompt(41, 3)
        assert store_tokens(eng, a, chunks_for(a)) == 3  # every store evicts the previous chunk
        assert eng.tiers[0].stats().evictions == 2


def test_an_engine_without_shared_writes_reads_shared_tiers_but_never_writes_them() -> None:
    """Replicated KV (MLA under tensor parallelism): one rank writes the shared tiers,
    the others only read them, and still fill their own CPU tier."""
    from lmcache_core.backend import SHARED

    class SharedDict(MemoryTier):
        name = "shared_dict"
        capabilities = frozenset({SHARED})

    shared = SharedDict()

    class Plugin:
        @hookimpl
        def register_backends(self, register: Any) -> None:
            register("shared_dict", lambda section, ctx: shared)

    def make(writes: bool) -> CacheEngine:
        pm = PluginManager(load_entry_points=False)
        pm.register(Plugin(), name="shared-tier")
        loaded = load_config(
            env={}, overrides={"chunk_size": CS, "backends": [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "shared_dict"}]}
        )
        return CacheEngine(loaded, namespace=NS, plugins=pm, shared_writes=writes)

    a = prompt(51, 2)
    reader, writer = make(False), make(True)
    try:
        assert store_tokens(reader, a, chunks_for(a)) == 2  # its own CPU tier
        assert reader.flush(10) and shared.stats().puts == 0
        assert store_tokens(writer, a, chunks_for(a)) == 2
        assert writer.flush(10) and shared.stats().puts == 2
        fresh = make(False)
        try:
            outs = empty_outs(2)
            assert retrieve_tokens(fresh, a, outs) == 2  # read from the shared tier, promoted locally
            assert all(torch.equal(o, c) for o, c in zip(outs, chunks_for(a)))
            assert fresh.flush(10) and shared.stats().puts == 2
            assert fresh.tiers[0].contains(fresh.keys(token_hashes(fresh, a))) == 2
        finally:
            fresh.close()
    finally:
        reader.close()
        writer.close()
