"""The default eviction policy, ``adaptive`` (:class:`lmcache_core.eviction.AdaptivePolicy`):
a prompt leaves the tier from its tail, a partial chunk first; the hints that tell it so
(``chain`` at lookup, ``partial`` at store) reach it from a real engine; it starts in
frequency order when nothing tells the orders apart and goes to recency when newcomers
come back; its tables stay consistent. Negative controls: LRU and TinyLFU evict a prompt
from its head, a policy without the hints ignores them, TinyLFU never goes to recency."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from lmcache_core.config import load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.eviction import (
    FREQUENCY,
    RECENCY,
    AdaptivePolicy,
    EvictionPolicy,
    LruPolicy,
    TinyLfuPolicy,
    _Rec,
    _Segments,
)
from lmcache_core.hookspecs import hookimpl
from lmcache_core.keys import KeyNamespace
from lmcache_core.plugins import PluginManager


def serve(policy: EvictionPolicy, prompts: Sequence[Sequence[Any]], capacity: int, partial: bool = False) -> list[int]:
    """Replay prompts of unit-size chunks through ``policy`` the way the engine drives
    the CPU tier: the chain hint at lookup, the resident prefix read (``hit``), the rest
    stored one by one (room made with ``pop_victim`` first), ``partial`` after storing a
    prompt's last chunk when ``partial``. The hit count of each prompt."""
    resident: set[Any] = set()
    hits = []
    for keys in prompts:
        policy.chain(keys)
        k = 0
        while k < len(keys) and keys[k] in resident:
            k += 1
        for key in keys[:k]:
            policy.hit(key)
        hits.append(k)
        for i, key in enumerate(keys[k:], start=k):
            if key in resident:
                continue
            while len(resident) >= capacity:
                victim = policy.pop_victim()
                assert victim in resident
                resident.discard(victim)
            policy.insert(key, 1)
            resident.add(key)
            if partial and i == len(keys) - 1:
                policy.partial(key)
    return hits


def prompt(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def victims(policy: EvictionPolicy, n: int) -> list[Any]:
    return [policy.pop_victim() for _ in range(n)]


def tail_first(order: list[Any], prompts: Sequence[Sequence[Any]]) -> bool:
    """Whether each prompt's chunks appear in ``order`` deepest first."""
    for keys in prompts:
        depth = {k: i for i, k in enumerate(keys)}
        seen = [depth[k] for k in order if k in depth]
        if seen != sorted(seen, reverse=True):
            return False
    return True


# -- prefix order -----------------------------------------------------------------------


def test_a_prompt_leaves_from_its_tail() -> None:
    """Two prompts that fill the tier: every victim is the deepest chunk left of its
    prompt, the least recently served prompt first. LRU and TinyLFU touch a prompt head
    first, so its head is their first victim (the rest is then unreachable)."""
    a, b = prompt("a", 6), prompt("b", 6)
    p = AdaptivePolicy(12)
    serve(p, [a, b], 12)
    order = victims(p, 12)
    assert sorted(order) == sorted(a + b) and tail_first(order, [a, b])
    assert order.index("a0") < order.index("b0")  # a was served before b
    for control in (LruPolicy(12), TinyLfuPolicy(12)):
        serve(control, [a, b], 12)
        order = victims(control, 12)
        assert not tail_first(order, [a, b]), control.name
        assert order.index("a0") < order.index("a5"), control.name


@pytest.mark.parametrize("mode", [RECENCY, FREQUENCY])
def test_both_orders_evict_tails_first(mode: str) -> None:
    """The same in each of the two orders the policy switches between (segments alone,
    chains applied when their last chunk is stored or read), and a prompt served again
    is the most recent: b, read again head first (promoted to protected, which is over
    its share in recency order), leaves last and from its tail."""
    a, b, c = prompt("a", 5), prompt("b", 5), prompt("c", 5)
    seg = _Segments(16, mode)
    for keys in (a, b, c):
        seg.chain(keys)
        for k in keys:
            seg.insert(k, 1)
    seg.chain(b)
    for k in b:
        seg.hit(k)
    order = []
    while (v := seg.pop()) is not None:
        order.append(v[0])
    assert len(order) == 15 and tail_first(order, [a, b, c])
    assert order.index("a0") < order.index("b0") and order.index("c0") < order.index("b0")


def test_a_gap_stops_the_order_at_what_can_be_hit() -> None:
    """Chunks after a gap in a prompt are not moved up with it: they can not be hit."""
    seg = _Segments(10, RECENCY)
    for k in ("x", "a0", "a2"):
        seg.insert(k, 1)
    seg.apply(["a0", "a1", "a2"])  # a1 is missing
    assert list(seg.probation) == ["x", "a2", "a0"]


@pytest.mark.parametrize("mode", [RECENCY, FREQUENCY])
def test_a_partial_chunk_is_the_next_victim(mode: str) -> None:
    """A prompt's last chunk, when partial, goes first even from the most recent prompt;
    without the hint the least recent prompt's tail does (the control)."""
    a, b = prompt("a", 6), prompt("b", 6)
    for hint in (True, False):
        seg = _Segments(100, mode)
        for keys in (b, a):
            seg.chain(keys)
            for k in keys:
                seg.insert(k, 1)
            if hint:
                seg.partial(keys[-1])
        first = seg.pop()
        assert first is not None and first[0] == ("a5" if hint else "b5")


def test_policies_without_the_hints_ignore_them() -> None:
    """The hints are optional: the base class's defaults do nothing (third-party
    policies written before them keep working and deciding as before)."""
    a, b = prompt("a", 4), prompt("b", 4)
    plain, hinted = LruPolicy(8), LruPolicy(8)
    for keys in (a, b):
        hinted.chain(keys)
        for k in keys:
            plain.insert(k, 1)
            hinted.insert(k, 1)
        hinted.partial(keys[-1])
    assert victims(plain, 8) == victims(hinted, 8)


# -- the hints from a real engine -------------------------------------------------------


class Recording(LruPolicy):
    """LRU that records the hints it gets."""

    name = "recording"
    calls: list[tuple[str, Any]] = []

    def chain(self, keys: Sequence[Any]) -> None:
        self.calls.append(("chain", list(keys)))

    def partial(self, key: Any) -> None:
        self.calls.append(("partial", key))


class Broken(LruPolicy):
    name = "broken_hints"

    def chain(self, keys: Sequence[Any]) -> None:
        raise RuntimeError("hint failed on purpose")


class _Policies:
    @hookimpl
    def register_eviction_policies(self, register: Any) -> None:
        register("recording", Recording)
        register("broken_hints", Broken)


def _engine(tmp_path: Path, policy: str, pm: PluginManager) -> CacheEngine:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"chunk_size: 16\nstaging_size: 1MiB\nbackends:\n  - name: local_cpu\n    max_size: 1MiB\n    eviction: {policy}\n"
    )
    return CacheEngine(load_config(cfg, env={}), namespace=KeyNamespace(model="m"), plugins=pm)


def test_engine_passes_the_chain_at_lookup_and_partial_chunks_at_store(tmp_path: Path) -> None:
    pm = PluginManager(load_entry_points=False)
    Recording.calls = []
    chunk = torch.zeros(8)
    hashes = [bytes([i]) * 16 for i in range(6)]
    with pm.registered(_Policies(), name="policies"), _engine(tmp_path, "recording", pm) as eng:
        keys = eng.keys(hashes)
        assert eng.lookup_hashes(hashes[:4]) == 0
        assert Recording.calls == [("chain", keys[:4])]  # the prompt, head first
        Recording.calls.clear()
        eng.lookup_hashes(hashes[:1], pin_id="r", add_pins=True)  # an object probed next to a hit: no chain
        eng.store_hashes(hashes[:1], [chunk], n_tokens=16)  # a whole chunk
        eng.store_hashes(hashes[1:3], [chunk, chunk])  # no token count: whole chunks
        assert Recording.calls == []
        eng.store_hashes(hashes[3:4], [chunk], n_tokens=5)  # a partial chunk
        eng.store_hashes(hashes[4:6], [chunk, chunk], n_tokens=16 + 7)  # the last of two is partial
        assert Recording.calls == [("partial", keys[3]), ("partial", keys[5])]


def test_a_tier_whose_hint_fails_still_serves(tmp_path: Path) -> None:
    pm = PluginManager(load_entry_points=False)
    hashes = [bytes([i]) * 16 for i in range(3)]
    with pm.registered(_Policies(), name="policies"), _engine(tmp_path, "broken_hints", pm) as eng:
        eng.store_hashes(hashes, [torch.zeros(8)] * 3)
        assert eng.lookup_hashes(hashes) == 3
        assert eng.stats()["backend_errors"]["local_cpu"] >= 1  # type: ignore[index]


# -- the choice of order ----------------------------------------------------------------


def test_first_pass_over_documents_keeps_the_first_ones_whole() -> None:
    """Documents read round robin, twice, through a tier half their size: nothing is
    read twice before the tier fills, so the policy starts in frequency order and keeps
    the first documents whole (LRU cycles through all of them and serves nothing)."""
    docs = [prompt(f"d{d}-", n) for d, n in enumerate((8, 12, 17, 22, 27, 32))]
    cap = sum(map(len, docs)) // 2
    p = AdaptivePolicy(cap)
    warm = serve(p, docs + docs, cap)[len(docs) :]
    assert p.mode == FREQUENCY
    assert sum(warm) >= 0.4 * sum(map(len, docs))
    assert sum(serve(LruPolicy(cap), docs + docs, cap)[len(docs) :]) == 0


@pytest.mark.parametrize("chunks", [200, 203])
def test_a_cycle_larger_than_the_tier_keeps_what_fits(chunks: int) -> None:
    """100 prompts of 8 chunks in a cycle through a tier of 200 chunks (a budget whose
    1% window and 99% main area are whole chunks: right after a victim the main area
    has room for exactly one more, so a newcomer must still win the duel to get in)
    and of 203: the first prompts stay and hit on every later pass; LRU, the control,
    evicts each prompt just before it comes back."""
    prompts = [prompt(f"p{i}-", 8) for i in range(100)]
    stream = prompts * 4
    p = AdaptivePolicy(chunks)
    hits = serve(p, stream, chunks)
    assert p.mode == FREQUENCY
    assert sum(hits[100:]) >= 0.9 * 3 * (chunks // 8) * 8
    assert sum(serve(LruPolicy(chunks), stream, chunks)) == 0


def _conversations(users: int = 200, turns: int = 6, new: int = 3, seed: int = 0) -> list[list[Any]]:
    """Multi-turn chats in random order: each turn is the user's history plus new chunks."""
    rng = random.Random(seed)
    history: dict[int, list[Any]] = {u: ["system"] for u in range(users)}
    left = dict.fromkeys(range(users), turns)
    out = []
    while left:
        u = rng.choice(sorted(left))
        history[u] += [(u, len(history[u]) + i) for i in range(new)]
        out.append(list(history[u]))
        left[u] -= 1
        if not left[u]:
            del left[u]
    return out


def test_recency_when_newcomers_come_back() -> None:
    """Conversations whose next turn comes back within the tier's reach: the shadows
    see recency win and the tier runs in recency order, far ahead of TinyLFU (which
    turns the new turns away) and close to LRU."""
    stream = _conversations()
    cap = len({k for keys in stream for k in keys}) // 5
    p = AdaptivePolicy(cap)
    hits = sum(serve(p, stream, cap))
    assert p.mode == RECENCY
    assert hits >= 1.3 * sum(serve(TinyLfuPolicy(cap), stream, cap))
    assert hits >= 0.95 * sum(serve(LruPolicy(cap), stream, cap))


# -- consistency ------------------------------------------------------------------------


def _consistent(seg: _Segments) -> None:
    segs = (seg.window, seg.probation, seg.protected)
    assert [sum(r.size for r in s.values()) for s in segs] == [seg.wbytes, seg.pbytes, seg.tbytes]
    records = {k: r for k, r in seg.info.items() if isinstance(r, _Rec)}
    assert seg.resident == len(records) == sum(map(len, segs))
    for s in segs:
        for k, r in s.items():
            assert records[k] is r and r.seg is s and 0 <= r.count <= seg.MAX_COUNT
    assert all(0 < c <= seg.MAX_COUNT for c in seg.info.values() if not isinstance(c, _Rec))
    assert len(seg.chains) <= seg.OPEN_CHAINS and set(seg.chain_end.values()) <= set(seg.chains)
    if seg.mode == RECENCY:
        assert not seg.window


@pytest.mark.parametrize("seed", range(4))
def test_tables_stay_consistent(seed: int) -> None:
    """Random prompts with every call the tier makes (reads, misses, stores of varying
    sizes, stores again, removals, pinned victims handed back, hints) and order switches
    forced along the way: bytes, records, segments and chains agree; victims are
    resident; the budget holds."""
    rng = random.Random(seed)
    cap = 400
    p = AdaptivePolicy(cap)
    p.SAMPLE = 64  # few sampled keys: the shadows evict too
    sizes: dict[Any, int] = {}
    used = 0
    for step in range(1500):
        keys = [(rng.randrange(6), i) for i in range(rng.randrange(1, 12))] if rng.random() < 0.7 else prompt(f"s{step}-", 3)
        p.chain(keys)
        for i, key in enumerate(keys):
            r = rng.random()
            if key in sizes and r < 0.85:
                p.hit(key)
            elif key in sizes and r < 0.9:
                p.remove(key)
                used -= sizes.pop(key)
            else:
                size = rng.choice((5, 8, 13))
                if key in sizes:  # stored again while resident (no larger: no room to make)
                    size = min(size, sizes[key])
                    p.insert(key, size)
                    used += size - sizes[key]
                    sizes[key] = size
                    continue
                p.miss(key)
                kept = []
                for _ in range(len(sizes)):
                    if used + size <= cap:
                        break
                    v = p.pop_victim()
                    assert v in sizes
                    if rng.random() < 0.1:
                        kept.append(v)  # pinned: handed back
                    else:
                        used -= sizes.pop(v)
                for v in kept:
                    p.keep(v, sizes[v])
                if used + size <= cap:
                    p.insert(key, size)
                    sizes[key] = size
                    used += size
                    if i == len(keys) - 1 and rng.random() < 0.3:
                        p.partial(key)
        if step % 300 == 150:
            p._use(1 - p.config)  # an order switch, as the shadows would make
        if step % 100 == 0:
            _consistent(p)
            for shadow in p._shadows():
                _consistent(shadow.seg)
                assert shadow.used <= shadow.budget
            assert len(p) == len(sizes) and used <= cap
