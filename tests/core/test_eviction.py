"""Issue #16: eviction policies as plugins, selected per tier in YAML; conformance of
the built-in ones (LRU is the negative control of the scan/cycle tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.config import ConfigError, load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.eviction import EvictionPolicy, LruPolicy, S3FifoPolicy, TinyLfuPolicy
from lmcache_core.hookspecs import hookimpl
from lmcache_core.keys import KeyNamespace
from lmcache_core.local_cpu import DEFAULT_EVICTION, LocalCpuBackend
from lmcache_core.plugins import PluginManager
from lmcache_core.testing import EvictionPolicyConformance
from lmcache_core.testing.policies import CHUNK_BYTES, cycle_hits, scan_kept

ROOT = Path(__file__).resolve().parents[2]


class TestLru(EvictionPolicyConformance):
    scan_resistant = False
    loop_resistant = False

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return LruPolicy(capacity)


class TestS3Fifo(EvictionPolicyConformance):
    loop_resistant = False  # a ghost hit enters the main FIFO, which a pure cycle still flushes

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return S3FifoPolicy(capacity)


class TestTinyLfu(EvictionPolicyConformance):
    def make_policy(self, capacity: int) -> EvictionPolicy:
        return TinyLfuPolicy(capacity)


def _tier(policy: EvictionPolicy, n: int) -> LocalCpuBackend:
    from lmcache_core.memory import MemoryPool

    return LocalCpuBackend(MemoryPool((n + 4) * CHUNK_BYTES), n * CHUNK_BYTES, policy)


def test_negative_controls_lru_loses_the_hot_set_and_every_cycle() -> None:
    """The scan and cycle checks can fail: LRU fails both (so does S3-FIFO on cycles)."""
    assert scan_kept(_tier(LruPolicy(100 * CHUNK_BYTES), 100)) == 0
    assert cycle_hits(_tier(LruPolicy(50 * CHUNK_BYTES), 50)) == 0
    assert cycle_hits(_tier(S3FifoPolicy(50 * CHUNK_BYTES), 50)) < 0.25 * 300
    assert scan_kept(_tier(S3FifoPolicy(100 * CHUNK_BYTES), 100)) >= 18
    assert cycle_hits(_tier(TinyLfuPolicy(50 * CHUNK_BYTES), 50)) >= 0.25 * 300


def _engine(tmp_path: Path, section: str, plugins: PluginManager | None = None) -> CacheEngine:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"chunk_size: 16\nstaging_size: 1MiB\nbackends:\n  - name: local_cpu\n    max_size: 1MiB\n{section}")
    return CacheEngine(load_config(cfg, env={}), namespace=KeyNamespace(model="m"), plugins=plugins)


@pytest.mark.parametrize("name", ["lru", "s3fifo", "tinylfu"])
def test_policy_selected_per_tier_in_yaml(tmp_path: Path, name: str) -> None:
    with _engine(tmp_path, f"    eviction: {name}\n") as eng:
        tier = eng.tiers[0]
        assert isinstance(tier, LocalCpuBackend)
        assert tier.policy.name == name
        assert eng.stats()["tiers"][0]["extra"]["eviction"] == name


def test_default_policy_is_the_scan_resistant_one(tmp_path: Path) -> None:
    with _engine(tmp_path, "") as eng:
        assert eng.tiers[0].policy.name == DEFAULT_EVICTION == "tinylfu"  # type: ignore[attr-defined]


def test_unknown_policy_names_key_source_and_choices(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"backends\[0\]\.eviction: unknown eviction policy 'lfru' \(from .*c\.yaml\); installed policies: lru, s3fifo, tinylfu",
    ):
        _engine(tmp_path, "    eviction: lfru\n")


class _FifoPolicy(LruPolicy):
    """A plugin policy: plain FIFO (hits do not refresh)."""

    name = "fifo"

    def hit(self, key: Any) -> None:
        return


class _FifoPlugin:
    @hookimpl
    def register_eviction_policies(self, register: Any) -> None:
        register("fifo", _FifoPolicy, description="first in, first out")


def test_plugin_policy_through_the_hook(tmp_path: Path) -> None:
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(ConfigError, match="unknown eviction policy 'fifo'"):
        _engine(tmp_path, "    eviction: fifo\n", plugins=pm)
    with pm.registered(_FifoPlugin(), name="fifo-plugin"):
        info = pm.eviction_policies()["fifo"]
        assert info.origin.plugin == "fifo-plugin" and info.description == "first in, first out"
        with _engine(tmp_path, "    eviction: fifo\n", plugins=pm) as eng:
            assert isinstance(eng.tiers[0].policy, _FifoPolicy)  # type: ignore[attr-defined]
    assert "fifo" not in pm.eviction_policies()


def test_factory_must_return_a_policy(tmp_path: Path) -> None:
    class Bad:
        @hookimpl
        def register_eviction_policies(self, register: Any) -> None:
            register("bad", lambda capacity: object())

    pm = PluginManager(load_entry_points=False)
    with pm.registered(Bad(), name="bad"):
        with pytest.raises(TypeError, match="returned object, not an EvictionPolicy"):
            _engine(tmp_path, "    eviction: bad\n", plugins=pm)


def test_engine_sweep_bars_quick() -> None:
    """The engine-level sweep (bench/bench_eviction.py --quick): tinylfu serves >= 40%
    of warm doc-QA tokens at 50% of the working set where LRU serves 0, and never
    fewer chat tokens than LRU."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_eviction.py"), "--quick", "--policies", "lru,tinylfu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS doc QA at 50%" in proc.stdout
    lru_line = next(line for line in proc.stdout.splitlines() if line.startswith("| docqa | 50% | lru |"))
    assert "| 0.0% |" in lru_line  # the negative control: LRU serves nothing there


def test_cli_lists_eviction_policies() -> None:
    proc = subprocess.run([sys.executable, "-m", "lmcache_core.cli", "plugins"], capture_output=True, text=True, timeout=60)
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert {r[1] for r in rows if r and r[0] == "eviction"} >= {"lru", "s3fifo", "tinylfu"}


def test_suite_prints_the_bars_from_sweep_points() -> None:
    """bench/suite/report.policy_bars: PASS/FAIL lines with the percentages, and a
    FAIL when the policy misses a bar (the check can fail)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_report", ROOT / "bench" / "suite" / "report.py")
    assert spec is not None and spec.loader is not None
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)

    def pt(workload: str, policy: str, f: float, hit: float, warm: float) -> dict[str, Any]:
        return {"workload": workload, "policy": policy, "disk": False, "fraction": f, "hit_rate": hit, "warm_hit_rate": warm}

    good = [
        pt("docqa", "lru", 0.5, 0.0, 0.0),
        pt("docqa", "tinylfu", 0.5, 0.2, 0.41),
        pt("chat", "lru", 0.5, 0.4, 0.4),
        pt("chat", "tinylfu", 0.5, 0.45, 0.45),
    ]
    lines = rep.policy_bars(good, "tinylfu")
    assert lines[0].startswith("PASS doc QA at 50%") and "41.0% of warm tokens" in lines[0] and "lru 0.0%" in lines[0]
    assert lines[1].startswith("PASS chat at 50%")
    bad = [pt("docqa", "tinylfu", 0.5, 0.1, 0.2), pt("chat", "lru", 0.25, 0.4, 0.4), pt("chat", "tinylfu", 0.25, 0.3, 0.3)]
    assert [line[:4] for line in rep.policy_bars(bad, "tinylfu")] == ["FAIL", "FAIL"]


def _tinylfu_consistent(p: TinyLfuPolicy) -> None:
    """The one-table encoding (``count << 2 | segment``) agrees with the segments."""
    segs = {1: p._window, 2: p._probation, 3: p._protected}
    for seg, od in segs.items():
        assert p._bytes[seg] == sum(od.values())
        for k in od:
            assert p._meta[k] & 3 == seg
    for k, v in p._meta.items():
        assert 0 < v < 64  # a small int; a key with neither count nor segment is dropped
        if v & 3:
            assert k in segs[v & 3]
    assert len(p) == sum(len(od) for od in segs.values())


def test_tinylfu_count_and_segment_table_stays_consistent() -> None:
    import random

    rnd = random.Random(7)
    p = TinyLfuPolicy(40 * 100)
    resident: dict[int, int] = {}
    used = 0
    for step in range(6000):  # several periodic halvings (every 1000 accesses here)
        k = rnd.randrange(120)
        if k in resident:
            r = rnd.random()
            if r < 0.05:
                p.remove(k)
                used -= resident.pop(k)
            elif r < 0.08:
                p.insert(k, resident[k])  # stored again while resident
            else:
                p.hit(k)
        else:
            p.miss(k)
            size = rnd.choice((50, 100, 200))
            kept = []
            for _ in range(len(resident)):  # one offer per resident key at most, as the tier does
                if used + size <= p.capacity:
                    break
                v = p.pop_victim()
                assert v is not None and v in resident
                if rnd.random() < 0.1:
                    kept.append(v)  # pinned: handed back
                    continue
                used -= resident.pop(v)
            for v in kept:
                p.keep(v, resident[v])
            if used + size <= p.capacity:
                p.insert(k, size)
                resident[k] = size
                used += size
        if step % 50 == 0:
            _tinylfu_consistent(p)
            assert set(p._window) | set(p._probation) | set(p._protected) == set(resident)
    # counts: exact until the next halving, capped at MAX_COUNT
    q = TinyLfuPolicy(10_000)
    q.insert("a", 100)
    for _ in range(3):
        q.hit("a")
    q.miss("b")
    assert (q.frequency("a"), q.frequency("b"), q.frequency("c")) == (4, 1, 0)
    for _ in range(30):
        q.hit("a")
    assert q.frequency("a") == TinyLfuPolicy.MAX_COUNT
    _tinylfu_consistent(q)
