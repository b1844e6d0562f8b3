"""Pins of a lookup, by prefix position: ``keep_pinned`` keeps exactly the first n
chunks of the last lookup pinned (whatever tier each sits in) and releases the rest
without a second lookup; ``add_pins`` pins an object probed next to the hit under
the same id (kept by ``keep_pinned``, released by ``unpin``); a lookup without it
replaces the id's pins."""

from __future__ import annotations

from lmcache_core.engine import CacheEngine
from lmcache_core.keys import chunk_hashes
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.testing import MemoryTier

from .helpers import TierPlugin
from .test_engine import CHUNK_BYTES, CS, chunks_for, engine, prompt


def _pinned(tier: LocalCpuBackend) -> int:
    return int(tier.stats().extra["pinned"])


def test_keep_pinned_and_add_pins_in_one_tier() -> None:
    with engine([{"name": "local_cpu", "max_size": "1MiB"}]) as eng:
        tier0 = eng.tiers[0]
        assert isinstance(tier0, LocalCpuBackend)
        a, b = prompt(1, 4), prompt(2, 1)
        ha, hb = chunk_hashes(a, CS), chunk_hashes(b, CS)
        assert eng.store_hashes(ha, chunks_for(a)) == 4
        assert eng.store_hashes(hb, chunks_for(b)) == 1
        assert eng.lookup_hashes(ha, pin_id="r") == 4
        assert _pinned(tier0) == 4
        eng.pins.keep("r", 2)
        assert _pinned(tier0) == 2
        assert eng.lookup_hashes(hb, pin_id="r", add_pins=True) == 1
        assert _pinned(tier0) == 3, "an added object is pinned next to the hit"
        eng.pins.keep("r", 1)
        assert _pinned(tier0) == 2, "keep_pinned cuts the hit, not the added object"
        eng.pins.release("r")
        assert _pinned(tier0) == 0
        # negative control: without add_pins a lookup replaces the id's pins
        assert eng.lookup_hashes(ha, pin_id="r") == 4
        assert eng.lookup_hashes(hb, pin_id="r") == 1
        assert _pinned(tier0) == 1
        eng.pins.keep("r", 0)
        assert _pinned(tier0) == 0
        eng.pins.keep("unknown", 3)  # an unknown id is ignored


def test_keep_pinned_counts_positions_across_tiers() -> None:
    """Chunks 0-1 only in a tier that does not pin, 2-3 only in the CPU tier (pinned
    at positions 2 and 3): keeping 3 chunks keeps the CPU tier's chunk 2 only."""
    plugin = TierPlugin()
    with engine([{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}], plugin) as eng:
        tier0, tier1 = eng.tiers
        assert isinstance(tier0, LocalCpuBackend) and isinstance(tier1, MemoryTier)
        a = prompt(3, 4)
        ha = chunk_hashes(a, CS)
        assert eng.store_hashes(ha, chunks_for(a)) == 4
        assert eng.flush(10)
        keys = eng.keys(ha)
        for k in keys[:2]:
            tier0.remove(k)
        for k in keys[2:]:
            tier1.remove(k)
        assert eng.lookup_runs(ha, pin_id="r") == [(1, 2), (0, 2)]
        assert _pinned(tier0) == 2
        eng.pins.keep("r", 3)
        assert _pinned(tier0) == 1
        eng.pins.keep("r", 2)
        assert _pinned(tier0) == 0
        eng.pins.release("r")


class _CountingTier(MemoryTier):
    """The reference tier, counting the lookups it answers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = {"contains": 0, "first_held": 0}

    def contains(self, keys):
        self.calls["contains"] += 1
        return super().contains(keys)

    def first_held(self, keys):
        self.calls["first_held"] += 1
        return super().first_held(keys)


def test_probe_boundary_asks_each_tier_once_and_pins_what_it_finds() -> None:
    """64 candidate boundary objects, longest hit first: one call finds the first one
    held (index 5, only in the slower tier; index 9 in both) with one ``first_held``
    per tier, pins it next to the hit in the CPU tier's copy when the CPU tier holds
    it, and the id's release frees everything. Control: probing them one lookup at a
    time, as before, asks the tiers once per candidate."""
    plugin = TierPlugin(factory=_CountingTier)
    with engine([{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}], plugin) as eng:
        tier0, tier1 = eng.tiers
        assert isinstance(tier0, LocalCpuBackend) and isinstance(tier1, _CountingTier)
        cands = [bytes([i + 1]) * 16 for i in range(64)]
        data = chunks_for(prompt(4, 1))
        assert eng.store_hashes([cands[9]], data) == 1
        assert eng.flush(10)
        tier1.put(eng.keys([cands[5]])[0], data[0])
        tier1.calls.update(contains=0, first_held=0)
        assert eng.probe_boundary(cands, pin_id="r") == 5
        assert tier1.calls == {"contains": 0, "first_held": 1}, tier1.calls
        assert eng.pins.ids() == set(), "the slower tier takes no pins: nothing to hold"
        tier0.put(eng.keys([cands[5]])[0], data[0])
        assert eng.probe_boundary(cands, pin_id="r") == 5
        assert _pinned(tier0) == 1 and eng.pins.held("r") == 1
        eng.pins.keep("r", 0)
        assert _pinned(tier0) == 1, "a boundary object is kept with the hit"
        eng.pins.release("r")
        eng.pins.release("r")  # a second release does nothing
        assert _pinned(tier0) == 0 and eng.pins.ids() == set()
        assert eng.probe_boundary(cands[10:], pin_id="r") == -1 and eng.pins.ids() == set()
        # control: the old way, one lookup per candidate until one hits
        tier1.calls.update(contains=0, first_held=0)
        probed = 0
        for h in cands:
            probed += 1
            if eng.lookup_hashes([h], record=False):
                break
        assert probed == 6 and tier1.calls["contains"] == 5, tier1.calls


def _pressure(eng: CacheEngine, seed: int) -> None:
    """Store 6 one-chunk prompts into a 4-chunk tier: every unpinned chunk is evicted."""
    for s in range(seed, seed + 6):
        p = prompt(s, 1)
        assert eng.store_hashes(chunk_hashes(p, CS), chunks_for(p)) == 1


def test_a_release_never_takes_another_requests_pin_on_a_chunk_stored_again() -> None:
    """Request A pins a prompt's chunks; they are erased and stored again; request B
    pins them; A's release must leave B's hold: under eviction pressure B's chunks
    stay. Controls: without B's pins the same pressure evicts them, and after B's
    release too."""
    with engine([{"name": "local_cpu", "max_size": f"{4 * CHUNK_BYTES}B", "eviction": "lru"}]) as eng:
        tier0 = eng.tiers[0]
        assert isinstance(tier0, LocalCpuBackend)
        a = prompt(7, 2)
        ha = chunk_hashes(a, CS)

        def stored_again() -> None:
            for k in eng.keys(ha):
                tier0.remove(k)  # what an erase, or the canary's repair, does
            assert eng.store_hashes(ha, chunks_for(a)) == 2

        assert eng.store_hashes(ha, chunks_for(a)) == 2
        assert eng.lookup_hashes(ha, pin_id="A") == 2
        stored_again()
        assert eng.lookup_hashes(ha, pin_id="B") == 2
        eng.pins.release("A")
        assert _pinned(tier0) == 2
        _pressure(eng, 100)
        assert eng.lookup_hashes(ha) == 2, "B's pinned chunks were evicted after A's release"
        eng.pins.release("B")
        assert _pinned(tier0) == 0
        _pressure(eng, 200)
        assert eng.lookup_hashes(ha) == 0  # control: unpinned, the same pressure evicts them
        # control: A pins, the chunks are stored again, nobody else pins: A's release frees them
        assert eng.store_hashes(ha, chunks_for(a)) == 2
        assert eng.lookup_hashes(ha, pin_id="A") == 2
        stored_again()
        eng.pins.release("A")
        _pressure(eng, 300)
        assert eng.lookup_hashes(ha) == 0
