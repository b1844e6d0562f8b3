"""A lookup costs work in proportion to the prompt, whatever the tiers' interleaving.
Counted in keys the tiers touch (not timed): a tier that stops at its first miss, and
one that checks every key it is handed (a batched remote lookup), with a prompt whose
chunks alternate between them."""

from __future__ import annotations

from typing import Any, Sequence

import pytest

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.backend import BackendStats, StorageBackend
from lmcache_core.config import load_config
from lmcache_core.lookup import KeyWindow
from lmcache_core.hookspecs import hookimpl
from lmcache_core.keys import ChunkKey
from lmcache_core.plugins import PluginManager

NS = KeyNamespace(model="lookup-scale")


class CountingTier(StorageBackend):
    """Holds a set of keys; counts every key its ``contains`` reads. ``batched``
    reads every key it is handed first (as Redis/Mooncake pipelines do). Not the
    reference tier: its lookup cost (every key, stopping early or not) is the subject."""

    def __init__(self, name: str, batched: bool) -> None:
        self.name = name
        self.batched = batched
        self.held: set[ChunkKey] = set()
        self.touched = 0
        self.calls = 0

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        self.calls += 1
        it = list(keys) if self.batched else keys
        if self.batched:
            self.touched += len(it)
        n = 0
        for k in it:
            if not self.batched:
                self.touched += 1
            if k not in self.held:
                break
            n += 1
        return n

    def put(self, key: ChunkKey, data: Any) -> bool:
        return False

    def get(self, key: ChunkKey, out: Any) -> bool:
        return False

    def remove(self, key: ChunkKey) -> bool:
        return False

    def stats(self) -> BackendStats:
        return BackendStats(self.name)


class _Plugin:
    def __init__(self, batched: tuple[bool, bool]) -> None:
        self.tiers = [CountingTier("t0", batched[0]), CountingTier("t1", batched[1])]

    @hookimpl
    def register_backends(self, register: Any) -> None:
        register("t0", lambda section, ctx: self.tiers[0])
        register("t1", lambda section, ctx: self.tiers[1])


def _engine(batched: tuple[bool, bool]) -> tuple[CacheEngine, _Plugin]:
    plugin = _Plugin(batched)
    pm = PluginManager(load_entry_points=False)
    pm.register(plugin, name="counting")
    loaded = load_config(env={}, overrides={"chunk_size": 4, "backends": [{"name": "t0"}, {"name": "t1"}]})
    return CacheEngine(loaded, namespace=NS, plugins=pm), plugin


def _touched(batched: tuple[bool, bool], n_chunks: int, pattern: str) -> tuple[int, int, list[tuple[int, int]]]:
    eng, plugin = _engine(batched)
    try:
        hashes = [i.to_bytes(16, "little") for i in range(n_chunks)]
        keys = eng.keys(hashes)
        for i, k in enumerate(keys):
            if pattern == "alternate":
                plugin.tiers[i % 2].held.add(k)
            elif pattern == "runs":  # runs of 1, 2, 3, ... chunks, tier by tier
                run, j = 0, i
                while j > run:
                    j -= run + 1
                    run += 1
                plugin.tiers[run % 2].held.add(k)
            else:
                plugin.tiers[1].held.add(k)
        runs = eng.lookup_runs(hashes)
        return sum(t.touched for t in plugin.tiers), sum(t.calls for t in plugin.tiers), runs
    finally:
        eng.close()


@pytest.mark.parametrize("batched", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("pattern", ["alternate", "runs", "all_in_tier1"])
def test_lookup_touches_keys_in_proportion_to_the_prompt(batched: tuple[bool, bool], pattern: str) -> None:
    small, large = 256, 2048
    t_small, calls_small, runs = _touched(batched, small, pattern)
    assert sum(n for _, n in runs) == small  # every chunk found
    if pattern == "alternate":
        assert runs[:3] == [(0, 1), (1, 1), (0, 1)]
    t_large, calls_large, _ = _touched(batched, large, pattern)
    per_key = t_large / large
    # Linear: the keys touched per chunk do not grow with the prompt (quadratic
    # work, as with slicing the rest of the keys per call, grows 8x here).
    assert t_large <= t_small * (large / small) * 1.1 + 64, (t_small, t_large)
    assert per_key <= 40, per_key
    assert calls_large <= 3 * large


def test_one_round_trip_when_the_prompt_lies_in_one_tier() -> None:
    _, calls, runs = _touched((True, True), 1024, "all_in_tier1")
    assert runs == [(1, 1024)] and calls == 2  # tier 0 misses once, tier 1 answers all


def test_slicing_the_rest_is_quadratic_negative_control() -> None:
    """The counting tier notices quadratic work: handing it the rest of the keys at
    each position (the former lookup) touches ~n^2/4 keys."""
    tier = CountingTier("t", batched=True)
    keys = NS.keys(i.to_bytes(16, "little") for i in range(512))
    tier.held = set(keys[::2])
    pos = 0
    while pos < len(keys):
        pos += max(1, tier.contains(keys[pos:]))
    assert tier.touched > 512 * 512 / 8


def test_key_window_is_a_sequence_view() -> None:
    keys = NS.keys(i.to_bytes(16, "little") for i in range(10))
    w = KeyWindow(keys, 3, 8)
    assert len(w) == 5 and list(w) == keys[3:8] and w[0] == keys[3] and w[-1] == keys[7]
    assert list(w[1:3]) == keys[4:6] and list(w[::2]) == keys[3:8:2] and keys[5] in w
    with pytest.raises(IndexError):
        w[5]
