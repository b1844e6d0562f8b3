"""Pins of a lookup, by prefix position: ``keep_pinned`` keeps exactly the first n
chunks of the last lookup pinned (whatever tier each sits in) and releases the rest
without a second lookup; ``add_pins`` pins an object probed next to the hit under
the same id (kept by ``keep_pinned``, released by ``unpin``); a lookup without it
replaces the id's pins."""

from __future__ import annotations

from lmcache_core.keys import chunk_hashes
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.testing import MemoryTier

from .helpers import TierPlugin
from .test_engine import CS, chunks_for, engine, prompt


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
        eng.keep_pinned("r", 2)
        assert _pinned(tier0) == 2
        assert eng.lookup_hashes(hb, pin_id="r", add_pins=True) == 1
        assert _pinned(tier0) == 3, "an added object is pinned next to the hit"
        eng.keep_pinned("r", 1)
        assert _pinned(tier0) == 2, "keep_pinned cuts the hit, not the added object"
        eng.unpin("r")
        assert _pinned(tier0) == 0
        # negative control: without add_pins a lookup replaces the id's pins
        assert eng.lookup_hashes(ha, pin_id="r") == 4
        assert eng.lookup_hashes(hb, pin_id="r") == 1
        assert _pinned(tier0) == 1
        eng.keep_pinned("r", 0)
        assert _pinned(tier0) == 0
        eng.keep_pinned("unknown", 3)  # an unknown id is ignored


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
        eng.keep_pinned("r", 3)
        assert _pinned(tier0) == 1
        eng.keep_pinned("r", 2)
        assert _pinned(tier0) == 0
        eng.unpin("r")
