"""One metric name, one meaning: the engine's plain counters, its Prometheus registry
and the connector's stats (vLLM's ``/metrics``) agree on what ``lookups``,
``lookup_tokens``, ``hit_tokens`` and ``load_errors`` count."""

from __future__ import annotations

import torch

from lmcache_core import CacheEngine, KeyNamespace, load_config, metrics
from lmcache_core.plugins import PluginManager
from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens, token_hashes

SHARED = ("lookups", "lookup_tokens", "hit_tokens", "load_errors")
CHUNK = 16


def _registry() -> dict[str, float]:
    values = {}
    for name in SHARED:
        v = metrics.REGISTRY.get_sample_value(f"{metrics.PREFIX}{name}_total")
        assert v is not None, name
        values[name] = v
    return values


def test_engine_counters_and_registry_count_the_same_things() -> None:
    cfg = load_config(
        env={}, overrides={"chunk_size": CHUNK, "staging_size": "4MiB", "backends": [{"name": "local_cpu", "max_size": "4MiB"}]}
    )
    with CacheEngine(cfg, namespace=KeyNamespace(model="meanings"), plugins=PluginManager(load_entry_points=False)) as eng:
        tokens = list(range(4 * CHUNK))
        chunks = [torch.full((8, 8), float(i), dtype=torch.float16) for i in range(4)]
        assert store_tokens(eng, tokens, chunks[:3]) == 3
        before_reg, before = _registry(), eng.counters.snapshot()
        assert lookup_tokens(eng, tokens) == 3 * CHUNK  # one lookup of 4 chunks, 3 found
        eng.tiers[0].remove(eng.keys(token_hashes(eng, tokens))[1])  # chunk 1 vanishes after the lookup
        outs = [torch.empty(8, 8, dtype=torch.float16) for _ in range(3)]
        assert retrieve_tokens(eng, tokens, outs) == 1  # chunks 1 and 2 fail to load
        after_reg, after = _registry(), eng.counters.snapshot()
    counted = {k: after[k] - before[k] for k in SHARED}
    assert counted == {"lookups": 1, "lookup_tokens": 4 * CHUNK, "hit_tokens": 3 * CHUNK, "load_errors": 2}
    assert {k: after_reg[k] - before_reg[k] for k in SHARED} == counted


def test_connector_stats_take_the_core_meanings() -> None:
    from lmcache_connector.protocol.stats import COUNTERS

    for key in SHARED:
        name, help_text = COUNTERS[key]
        assert name == key and help_text == metrics.MEANINGS[key]
        collector = metrics.REGISTRY._names_to_collectors[f"{metrics.PREFIX}{key}"]
        assert collector._documentation == help_text
