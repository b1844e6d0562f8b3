"""The engine subscribes to a tier's evictions with an explicit call,
``StorageBackend.subscribe_evictions(callback)``, once, on its first listener; tiers
that watch a server for evictions start there. The ``on_evicted`` attribute the engine
used to set keeps working for one release, with a ``DeprecationWarning``: for code that
sets it, and for a plugin class that overrides it (its setter still gets the engine's
callback, so a watcher it starts there still starts).

Real engines over real in-memory tiers (the reference ``MemoryTier``)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import pytest

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.config import load_config
from lmcache_core.engine import TierEvent
from lmcache_core.hookspecs import hookimpl
from lmcache_core.keys import ChunkKey
from lmcache_core.plugins import PluginManager
from lmcache_core.testing import random_key

from lmcache_core.testing import MemoryTier

NS = KeyNamespace(model="eviction-subscription", layout="test", dtype="float16")


class WatchingTier(MemoryTier):
    """A tier that learns of evictions from elsewhere: it starts its 'watcher' (counted)
    when the engine subscribes, as the Redis and peer tiers do."""

    name = "watching"

    def __init__(self) -> None:
        super().__init__()
        self.watchers_started = 0

    def subscribe_evictions(self, callback: Callable[[ChunkKey], None]) -> None:
        super().subscribe_evictions(callback)
        self.watchers_started += 1


def _legacy_property_tier() -> type[MemoryTier]:
    """A plugin written before subscribe_evictions, the way the Redis tier was: a
    property whose setter (called by the old engine) starts the watcher."""

    class LegacyTier(MemoryTier):
        name = "legacy"

        def __init__(self) -> None:
            super().__init__()
            self._cb: Callable[[ChunkKey], None] | None = None
            self.watchers_started = 0

        @property
        def on_evicted(self) -> Callable[[ChunkKey], None] | None:
            return self._cb

        @on_evicted.setter
        def on_evicted(self, cb: Callable[[ChunkKey], None] | None) -> None:
            self._cb = cb
            if cb is not None:
                self.watchers_started += 1

    return LegacyTier


def _legacy_attribute_tier() -> type[MemoryTier]:
    """A plugin that declared the attribute itself."""

    class PlainLegacyTier(MemoryTier):
        name = "plain_legacy"
        on_evicted: Callable[[ChunkKey], None] | None = None

    return PlainLegacyTier


class _Plugin:
    def __init__(self, cls: type[MemoryTier]) -> None:
        self.cls = cls
        self.created: list[MemoryTier] = []

    @hookimpl
    def register_backends(self, register: Any) -> None:
        def factory(section: Any, ctx: Any) -> MemoryTier:
            tier = self.cls()
            self.created.append(tier)
            return tier

        register(self.cls.name, factory)


def engine_over(cls: type[MemoryTier]) -> tuple[CacheEngine, MemoryTier]:
    pm = PluginManager(load_entry_points=False)
    plugin = _Plugin(cls)
    pm.register(plugin, name=f"tiers-{cls.name}")
    loaded = load_config(
        env={}, overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "1MiB"}, {"name": cls.name}]}
    )
    eng = CacheEngine(loaded, namespace=NS, plugins=pm)
    return eng, plugin.created[0]


@pytest.fixture
def no_deprecations() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_the_first_listener_subscribes_each_tier_once(no_deprecations: None) -> None:
    eng, tier = engine_over(WatchingTier)
    with eng:
        assert isinstance(tier, WatchingTier) and tier.watchers_started == 0  # nobody listens yet: no watcher
        events: list[TierEvent] = []
        eng.add_listener(events.append)
        eng.add_listener(lambda ev: None)
        assert tier.watchers_started == 1
        key = random_key()
        tier.evicted(key)
        assert events == [TierEvent("evicted", "watching", key)]


def test_setting_on_evicted_is_deprecated_and_still_subscribes() -> None:
    tier = WatchingTier()
    seen: list[ChunkKey] = []
    with pytest.warns(DeprecationWarning, match="subscribe_evictions"):
        tier.on_evicted = seen.append
    assert tier.watchers_started == 1 and tier.on_evicted == seen.append
    key = random_key()
    tier.evicted(key)
    assert seen == [key]
    with pytest.warns(DeprecationWarning):
        tier.on_evicted = None  # unsubscribes
    tier.evicted(random_key())
    assert seen == [key]


@pytest.mark.parametrize("make", [_legacy_property_tier, _legacy_attribute_tier], ids=["property", "attribute"])
def test_a_plugin_overriding_on_evicted_warns_and_still_gets_the_engines_callback(make: Callable[[], type[MemoryTier]]) -> None:
    with pytest.warns(DeprecationWarning, match="overrides StorageBackend.on_evicted"):
        cls = make()
    eng, tier = engine_over(cls)
    with eng:
        events: list[TierEvent] = []
        eng.add_listener(events.append)
        if hasattr(tier, "watchers_started"):
            assert tier.watchers_started == 1  # its setter ran: the watcher it starts there started
        key = random_key()
        tier.evicted(key)
        assert events == [TierEvent("evicted", cls.name, key)]


def test_a_tier_without_overrides_needs_no_deprecated_name(no_deprecations: None) -> None:
    """Positive control for the warnings above: the default path (the CPU tier's real
    evictions and a plain tier's reports) raises no DeprecationWarning."""
    eng, tier = engine_over(MemoryTier)
    with eng:
        events: list[TierEvent] = []
        eng.add_listener(events.append)
        key = random_key()
        tier.evicted(key)
        eng.tiers[0].evicted(key)
        assert events == [TierEvent("evicted", "memory", key), TierEvent("evicted", "local_cpu", key)]
