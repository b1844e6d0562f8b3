"""The online cost models behind ``connector.load_policy: faster_than_recompute``: a fit of a
tier's read latency and throughput (one measured size predicts the mean, never below
zero; bad samples are ignored), and an engine that measures each tier it reads and
reports which tier holds each run of a hit."""

from __future__ import annotations

import random

import pytest
import torch

from lmcache_core.config import CoreConfig
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import ChunkKey, KeyNamespace
from lmcache_core.loadcost import LinearFit, TierReadModel
from lmcache_core.plugins import PluginManager
from lmcache_core.testing import MemoryTierPlugin
from lmcache_core.testing.tokens import token_hashes


def test_fit_recovers_latency_and_throughput() -> None:
    m = TierReadModel()
    rng = random.Random(1)
    for _ in range(64):
        n = rng.choice([1 << 20, 2 << 20, 4 << 20])
        m.record(n, 0.005 + n / 1e9 * (1 + rng.uniform(-0.02, 0.02)))
    d = m.describe()
    assert d["latency_s"] == pytest.approx(0.005, rel=0.1)
    assert d["throughput_bps"] == pytest.approx(1e9, rel=0.05)
    assert m.predict(8 << 20) == pytest.approx(0.005 + (8 << 20) / 1e9, rel=0.05)


def test_fit_with_one_size_predicts_the_mean_and_stays_non_negative() -> None:
    f = LinearFit(1)
    assert f.predict((1.0,)) is None  # nothing measured yet
    for y in (0.30, 0.31, 0.29):
        f.add((2 << 20,), y)
    assert f.predict((2 << 20,)) == pytest.approx(0.30, abs=0.005)
    g = LinearFit(2, min_samples=3)
    for x, y in (((100, 1e4), 0.5), ((200, 4e4), 0.4), ((300, 9e4), 0.3), ((400, 1.6e5), 0.2)):
        g.add(x, y)  # decreasing with size: negative slopes are dropped, not used
    coef = g.coefficients()
    assert coef is not None and (coef >= 0).all()
    f.add((1,), float("nan"))
    f.add((1,), -1.0)
    assert f.count == 3  # bad samples ignored


def test_engine_measures_each_tier_and_reports_where_hits_are() -> None:
    pm = PluginManager(load_entry_points=False)
    with pm.registered(MemoryTierPlugin("slowread", get_delay_s=0.03), name="slow"):
        cfg = CoreConfig(
            chunk_size=4, staging_size="4MiB", backends=[{"name": "local_cpu", "max_size": "1MiB"}, {"name": "slowread"}]
        )
        with CacheEngine(cfg, namespace=KeyNamespace(model="m"), plugins=pm) as eng:
            tokens = list(range(16))  # 4 chunks
            hashes = token_hashes(eng, tokens)
            data = [torch.full((64,), float(i)) for i in range(4)]
            eng.store_hashes(hashes, data)
            assert eng.flush(10)
            for h in hashes[2:]:
                eng.tiers[0].remove(ChunkKey(eng.namespace.id, h))  # chunks 2, 3 only in the slow tier
            assert eng.lookup_runs(hashes) == [(0, 2), (1, 2)]
            assert eng.read_estimate(1, 256).seconds is None  # never read
            for i, h in enumerate(hashes):
                buf = eng.retrieve_buffer(h, (64,), torch.float32)
                assert buf is not None and torch.equal(buf.tensor, data[i])
                buf.release()
            slow, fast = eng.read_estimate(1, 256).seconds, eng.read_estimate(0, 256).seconds
            assert slow is not None and 0.025 <= slow <= 0.2
            assert fast is not None and fast < 0.01
            assert eng.lookup_runs(hashes) == [(0, 4)]  # promoted on read
