"""Eviction policies as plugins, selected per tier in YAML; conformance of the built-in
ones (LRU is the negative control of the scan/cycle tests). The default policy's own
behaviour (prefix order, hints, order switching): test_eviction_adaptive.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.config import ConfigError, load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.eviction import AdaptivePolicy, EvictionPolicy, LruPolicy, S3FifoPolicy, TinyLfuPolicy
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


class TestAdaptive(EvictionPolicyConformance):
    def make_policy(self, capacity: int) -> EvictionPolicy:
        return AdaptivePolicy(capacity)


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
    assert cycle_hits(_tier(AdaptivePolicy(50 * CHUNK_BYTES), 50)) >= 0.25 * 300


def _engine(tmp_path: Path, section: str, plugins: PluginManager | None = None) -> CacheEngine:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"chunk_size: 16\nstaging_size: 1MiB\nbackends:\n  - name: local_cpu\n    max_size: 1MiB\n{section}")
    return CacheEngine(load_config(cfg, env={}), namespace=KeyNamespace(model="m"), plugins=plugins)


@pytest.mark.parametrize("name", ["lru", "s3fifo", "tinylfu", "adaptive"])
def test_policy_selected_per_tier_in_yaml(tmp_path: Path, name: str) -> None:
    with _engine(tmp_path, f"    eviction: {name}\n") as eng:
        tier = eng.tiers[0]
        assert isinstance(tier, LocalCpuBackend)
        assert tier.policy.name == name
        assert eng.stats()["tiers"][0]["extra"]["eviction"] == name


def test_default_policy_is_the_adaptive_one(tmp_path: Path) -> None:
    with _engine(tmp_path, "") as eng:
        assert eng.tiers[0].policy.name == DEFAULT_EVICTION == "adaptive"  # type: ignore[attr-defined]


def test_unknown_policy_names_key_source_and_choices(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"backends\[0\]\.eviction: unknown eviction policy 'lfru' \(from .*c\.yaml\); installed policies: adaptive, lru, s3fifo, tinylfu",
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
    """The engine-level sweep (bench/bench_eviction.py --quick): the default policy
    serves >= 40% of warm doc-QA tokens at 50% of the working set where LRU serves 0,
    and never fewer chat tokens than LRU."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_eviction.py"),
            "--quick",
            "--no-traces",
            "--no-cost",
            "--policies",
            "lru,adaptive",
        ],
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
    assert {r[1] for r in rows if r and r[0] == "eviction"} >= {"lru", "s3fifo", "tinylfu", "adaptive"}


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


class _ListTinyLfu:
    """W-TinyLFU written plainly: segments as lists (least recent first), counts and
    places in plain dicts. The decisions :class:`TinyLfuPolicy` must make, whatever
    its tables look like. ``mutant``: protected overflow demotes the most recent key
    instead of the least recent (the negative control)."""

    def __init__(self, capacity: int, mutant: bool = False) -> None:
        self.window_budget = 0.01 * capacity
        self.main_budget = capacity - self.window_budget
        self.seg: dict[int, list[Any]] = {1: [], 2: [], 3: []}
        self.size: dict[Any, int] = {}
        self.where: dict[Any, int] = {}
        self.count: dict[Any, int] = {}
        self.samples = 0
        self.mutant = mutant

    def bytes(self, s: int) -> int:
        return sum(self.size[k] for k in self.seg[s])

    def bump(self, key: Any) -> None:
        self.count[key] = min(self.count.get(key, 0) + 1, 15)
        self.samples += 1
        if self.samples >= 1000 and self.samples >= 10 * len(self.where):
            self.samples = 0
            self.count = {k: c // 2 for k, c in self.count.items() if c // 2}

    def detach(self, key: Any) -> int:
        self.seg[self.where.pop(key)].remove(key)
        return self.size.pop(key)

    def attach(self, s: int, key: Any, size: int) -> None:
        self.seg[s].append(key)
        self.where[key] = s
        self.size[key] = size

    def insert(self, key: Any, size: int) -> None:
        self.bump(key)
        if key in self.where:
            self.detach(key)
        self.attach(1, key, size)
        while self.bytes(1) > self.window_budget and len(self.seg[1]) > 1:
            old = self.seg[1][0]
            if self.bytes(2) + self.bytes(3) + self.size[old] > self.main_budget:
                break
            self.attach(2, old, self.detach(old))

    def hit(self, key: Any) -> None:
        self.bump(key)
        s = self.where.get(key)
        if s in (1, 3):
            self.attach(s, key, self.detach(key))
        elif s == 2:
            self.attach(3, key, self.detach(key))
            while self.bytes(3) > 0.8 * self.main_budget and len(self.seg[3]) > 1:
                old = self.seg[3][-1 if self.mutant else 0]
                self.attach(2, old, self.detach(old))

    def miss(self, key: Any) -> None:
        self.bump(key)

    def remove(self, key: Any) -> None:
        if key in self.where:
            self.detach(key)

    def pop_victim(self) -> Any:
        main = (self.seg[2] or self.seg[3] or [None])[0]
        if self.seg[1] and self.bytes(1) > self.window_budget:
            cand = self.seg[1][0]
            if main is not None and self.count.get(cand, 0) > self.count.get(main, 0):
                self.attach(2, cand, self.detach(cand))  # admitted; the main victim leaves
                self.detach(main)
                return main
            self.detach(cand)
            return cand
        victim = main if main is not None else (self.seg[1] or [None])[0]
        if victim is not None:
            self.detach(victim)
        return victim

    def keep(self, key: Any, size: int) -> None:
        if key not in self.where:
            self.attach(2, key, size)


def _tinylfu_consistent(p: TinyLfuPolicy) -> None:
    """The packed table (segment, count, size code) agrees with the segment queues."""
    live = {seg: p._live(seg) for seg in (1, 2, 3)}
    for seg, keys in live.items():
        assert p._n[seg] == len(keys) and len(set(keys)) == len(keys)
        assert p._bytes[seg] == sum(p._size(k, p._meta[k]) for k in keys)
        assert len(p._q[seg]) <= 2 * len(keys) + 65  # stale places stay bounded
        for k in keys:
            assert p._meta[k] & 3 == seg
    for k, v in p._meta.items():
        assert v > 0  # a key with neither count nor segment is dropped
        if v & 3:
            assert k in live[v & 3]
    assert set(p._odd) <= {k for k, v in p._meta.items() if v & 3 and not v >> 6}
    assert len(p) == sum(len(keys) for keys in live.values())


def _tinylfu_trace(p: TinyLfuPolicy, model: _ListTinyLfu, seed: int, steps: int) -> int | None:
    """Drive the policy and the model through one random trace the way a tier does
    (inserts, hits, misses, removals, re-inserts with a new size, pinned victims
    handed back); the first step where they disagree, or None."""
    import random

    rnd = random.Random(seed)
    resident: dict[int, int] = {}
    used = 0
    sizes = (100, 150, 200, 250, 300, 400)
    for step in range(steps):
        k = rnd.randrange(300) if rnd.random() < 0.8 else rnd.randrange(3000)
        r = rnd.random()
        if k in resident:
            if r < 0.05:
                p.remove(k)
                model.remove(k)
                used -= resident.pop(k)
            elif r < 0.08:
                size = rnd.choice(sizes)  # stored again while resident
                p.insert(k, size)
                model.insert(k, size)
                used += size - resident[k]
                resident[k] = size
            else:
                p.hit(k)
                model.hit(k)
        else:
            p.miss(k)
            model.miss(k)
            size = rnd.choice(sizes)
            kept = []
            for _ in range(len(resident)):  # one offer per resident key at most, as the tier does
                if used + size <= p.capacity:
                    break
                v = p.pop_victim()
                if v != model.pop_victim():
                    return step
                assert v is not None and v in resident
                if rnd.random() < 0.1:
                    kept.append(v)  # pinned: handed back
                    continue
                used -= resident.pop(v)
            for v in kept:
                p.keep(v, resident[v])
                model.keep(v, resident[v])
            if used + size <= p.capacity:
                p.insert(k, size)
                model.insert(k, size)
                resident[k] = size
                used += size
        if step % 100 == 0:
            if any(p._live(s) != model.seg[s] for s in (1, 2, 3)) or len(p) != len(model.where):
                return step
            if any(p.frequency(x) != model.count.get(x, 0) for x in list(resident)[:40] + [rnd.randrange(3000)]):
                return step
            _tinylfu_consistent(p)
    return None


@pytest.mark.parametrize("size_codes", [TinyLfuPolicy.SIZE_CODES, 2])
def test_tinylfu_decisions_match_the_plain_list_model(size_codes: int) -> None:
    """Victims, segment orders and counts equal those of the plain model over random
    traces (several halvings, queue rebuilds; with 2 size codes most sizes take the
    odd-size path); the mutant model (negative control) is told apart."""
    for seed in range(3):
        p = TinyLfuPolicy(60_000)
        p.SIZE_CODES = size_codes
        assert _tinylfu_trace(p, _ListTinyLfu(60_000), seed, 6000) is None
        if size_codes == 2:
            assert p._odd  # the odd-size path was taken
    assert _tinylfu_trace(TinyLfuPolicy(60_000), _ListTinyLfu(60_000, mutant=True), 0, 6000) is not None


def test_tinylfu_counts_exact_until_halving() -> None:
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
