"""KV-cache events for cache-aware routers: what lmcache-core's tiers hold, in vLLM's
event format (``BlockStored`` / ``BlockRemoved``), published by vLLM's own publisher
(``--kv-events-config``) next to vLLM's GPU-cache events.

Path: each worker's :class:`~lmcache_core.engine.CacheEngine` reports every object
that reaches a tier and every object a tier evicts (a core listener); the worker ships
them once per step (``get_kv_connector_kv_cache_events``); vLLM merges the ranks'
batches and hands them to the scheduler (``update_connector_output``), which knows
the vLLM block hashes of the objects it asked to save and turns them into events
(``take_events``).

Events carry what vLLM 0.32's own events carry per KV-cache group: ``group_idx``,
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` of the group, the
group's ``block_size``, and vLLM's block hashes viewed at that block size (the same
hash names a block in every group; ``group_idx`` tells them apart). What one stored
object announces:

* a chunk object (dense models, and the full-attention groups of hybrid models): one
  ``BlockStored`` per full-attention group for the chunk's blocks;
* a boundary object after ``E`` tokens (hybrid models): per sliding-window group the
  blocks of the window before ``E`` (what vLLM's own cache keeps for a hit at ``E``);
  per state group (Mamba, gated delta-net) the one block whose state is the state
  after ``E`` tokens, when ``E`` is a multiple of the group's block size (vLLM's
  "align" mode; otherwise vLLM has no block hash for that state and none is sent).

Windows of neighbouring boundaries can share blocks: a window block is announced in
a tier when the first object holding it arrives there and removed when the last one
leaves (counted per tier and group), so a router keeping a set stays right.

``medium`` names the tier: ``lmcache:<tier name>`` (``lmcache:local_cpu``,
``lmcache:disk``, ...). Under tensor parallelism an object counts as stored in a tier
once every rank that writes it has stored its shard there (a hit needs them all),
and as removed as soon as one rank evicts it.

Bounds: the scheduler remembers at most ``max_chunks`` objects (oldest forgotten
first; an eviction of a forgotten object is not announced), and each worker buffers
at most ``MAX_PENDING`` events between steps (the excess is dropped and counted).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

from lmcache_core.engine import TierEvent

from ..layouts.groups import FULL, STATE, WINDOW, GroupInfo, GroupPlan
from ..log import get_logger

log = get_logger(__name__)

MEDIUM_PREFIX = "lmcache:"
MAX_PENDING = 1 << 16
DEFAULT_MAX_CHUNKS = 1 << 15

#: (rank, "stored" | "evicted", tier name, chunk hash)
RawEvent = tuple[int, str, str, bytes]


def medium(tier: str) -> str:
    return MEDIUM_PREFIX + tier


def events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


class TierEventBuffer:
    """Worker side: a core listener that keeps this model's tier events (any rank's
    namespace: a shared disk tier evicts the other ranks' files too) until the step
    ships them. Quick and bounded: it runs under tier locks."""

    def __init__(self, rank: int, namespaces: Iterable[bytes], maxlen: int = MAX_PENDING) -> None:
        """``namespaces[r]``: rank ``r``'s key namespace (a single one when the KV is
        replicated across ranks: its events are then this rank's)."""
        self.rank = rank
        ns = [bytes(n) for n in namespaces]
        self._ns = {n: r for r, n in enumerate(ns)} if len(ns) > 1 else {n: rank for n in ns}
        self._q: deque[RawEvent] = deque()
        self._maxlen = maxlen
        self._lock = threading.Lock()
        self.dropped = 0

    def __call__(self, ev: TierEvent) -> None:
        r = self._ns.get(ev.key.namespace)
        if r is None:
            return  # another model's chunk in a shared tier
        with self._lock:
            if len(self._q) >= self._maxlen:
                self.dropped += 1
                return
            self._q.append((r, ev.kind, ev.tier, ev.key.chunk_hash))

    def take(self) -> list[RawEvent]:
        with self._lock:
            out, self._q = list(self._q), deque()
        return out


class LMCacheCoreKVEvents(KVConnectorKVEvents):
    """The container vLLM merges across workers: raw tier events, translated on the
    scheduler (only it knows vLLM's block hashes)."""

    def __init__(self, events: Sequence[RawEvent] = (), workers: int = 1) -> None:
        self._events = list(events)
        self._workers = workers

    def add_events(self, events: list[Any]) -> None:
        self._events.extend(events)

    def aggregate(self) -> "LMCacheCoreKVEvents":
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []

    def __repr__(self) -> str:
        return f"<LMCacheCoreKVEvents events={len(self._events)} workers={self._workers}>"


@dataclass(frozen=True)
class EventGroup:
    """One vLLM KV-cache group as events name it."""

    index: int  # vLLM's group index (``group_idx``)
    role: str  # FULL, WINDOW or STATE (what the connector stores for it)
    block_size: int
    kind: str | None = "full_attention"  # vLLM's ``kv_cache_spec_kind``
    window: int | None = None  # vLLM's ``kv_cache_spec_sliding_window``
    info: GroupInfo | None = None

    def blocks(self, lo: int, hi: int) -> range:
        """Block indexes a chunk object of tokens ``lo..hi`` holds (FULL), or that the
        boundary object at ``hi`` holds (WINDOW, STATE): whole blocks only."""
        bs = self.block_size
        if self.role == FULL:
            return range(lo // bs, hi // bs)
        if self.role == WINDOW and self.info is not None:
            return range(self.info.window_blocks(hi).start, hi // bs)
        if self.role == STATE and hi % bs == 0 and self.info is not None and self.info.state_mode == "align":
            return range(hi // bs - 1, hi // bs)
        return range(0)


def event_groups(kv_cache_config: Any, plan: GroupPlan) -> list[EventGroup]:
    """The groups of ``plan`` with the kind and window vLLM's own events give them."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    specs = getattr(kv_cache_config, "kv_cache_groups", None) or []
    out = []
    for g in plan.groups:
        kind, window = "full_attention", None
        if g.index < len(specs):
            spec = specs[g.index].kv_cache_spec
            kind, window = get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)
        out.append(EventGroup(g.index, g.kind, g.block_size, kind, window, g))
    return out


@dataclass
class _Part:
    """The blocks of one group that one stored object holds."""

    group: EventGroup
    first: int  # index of the first block
    block_hashes: list[Any]
    parent: Any
    tokens: array


@dataclass
class _Chunk:
    parts: list[_Part]
    lora_name: str | None
    lora_id: int | None
    reported: dict[str, set[int]] = field(default_factory=dict)  # medium -> ranks holding it
    announced: set[str] = field(default_factory=set)


class EventTranslator:
    """Scheduler side: remembers the vLLM block hashes of objects being saved and turns
    the workers' tier events into vLLM events."""

    def __init__(
        self,
        *,
        chunk_size: int,
        hash_block_size: int,
        writers: Sequence[int],
        groups: Sequence[EventGroup] | None = None,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        """``writers``: the ranks that store each object (all of them, or rank 0 alone
        when the KV is replicated across ranks). ``groups``: the model's KV-cache
        groups (default: one full-attention group of ``hash_block_size``)."""
        self.cs = chunk_size
        self.hbs = hash_block_size
        self.writers = frozenset(writers)
        self.max_chunks = max_chunks
        self.groups = list(groups) if groups else [EventGroup(0, FULL, hash_block_size)]
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        # Window blocks held per (medium, group, block hash): neighbouring boundary
        # objects share them (bounded by the remembered objects).
        self._held: dict[tuple[str, int, Any], int] = {}
        self._out: list[KVCacheEvent] = []
        self.unknown = 0  # events about objects not (or no longer) remembered

    def remember(self, request: Any, chunk: int, chunk_hash: bytes, end: int) -> None:
        """Chunk ``chunk`` (tokens up to ``end``) of ``request`` is about to be saved."""
        self._remember(request, chunk_hash, chunk * self.cs, end, FULL)

    def remember_boundary(self, request: Any, key: bytes, end: int) -> None:
        """The boundary object ``key`` after ``end`` tokens of ``request`` (windows and
        states of hybrid models) is about to be saved."""
        self._remember(request, key, end, end, WINDOW, STATE)

    def _remember(self, request: Any, key: bytes, lo: int, hi: int, *roles: str) -> None:
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return
        raw = list(getattr(request, "block_hashes", None) or [])
        parts = []
        for g in self.groups:
            if g.role not in roles:
                continue
            rng = g.blocks(lo, hi)
            if not rng or g.block_size % self.hbs:
                continue
            hashes = resolve_block_hashes(raw, self.hbs, g.block_size) if g.block_size != self.hbs else raw
            if len(hashes) < rng.stop:
                continue  # hashes not computed that far (yet)
            bs = g.block_size
            parts.append(
                _Part(
                    group=g,
                    first=rng.start,
                    block_hashes=[maybe_convert_block_hash(hashes[i]) for i in rng],
                    parent=maybe_convert_block_hash(hashes[rng.start - 1]) if rng.start else None,
                    tokens=array("q", request.all_token_ids[rng.start * bs : rng.stop * bs]),
                )
            )
        if not parts:
            return  # a partial chunk with no full vLLM block, or nothing vLLM can name
        lora = getattr(request, "lora_request", None)
        self._chunks[key] = _Chunk(parts, lora.lora_name if lora else None, lora.lora_int_id if lora else None)
        while len(self._chunks) > self.max_chunks:
            _, old = self._chunks.popitem(last=False)
            for med in old.announced:  # forgotten: its removal can no longer be announced
                self._release(old, med)

    def add(self, container: Any) -> None:
        """A step's merged worker events (``KVConnectorOutput.kv_cache_events``)."""
        if not isinstance(container, LMCacheCoreKVEvents):
            return
        for rank, kind, tier, h in container.get_all_events():
            c = self._chunks.get(h)
            if c is None:
                self.unknown += 1
                continue
            med = medium(tier)
            held = c.reported.setdefault(med, set())
            if kind == "stored":
                held.add(rank)
                if med not in c.announced and self.writers <= held:
                    c.announced.add(med)
                    for part in c.parts:
                        self._stored(c, part, med)
            elif kind == "evicted":
                held.discard(rank)
                if med in c.announced:
                    c.announced.discard(med)
                    for part, hashes in self._release(c, med):
                        self._out.append(BlockRemoved(block_hashes=hashes, medium=med, group_idx=part.group.index))

    def _stored(self, c: _Chunk, part: _Part, med: str) -> None:
        idx: Sequence[int] = range(len(part.block_hashes))
        if part.group.role == WINDOW:  # only blocks no other object of this tier holds yet
            gi = part.group.index
            idx = [i for i in idx if self._held.get((med, gi, part.block_hashes[i]), 0) == 0]
            for h in part.block_hashes:
                self._held[(med, gi, h)] = self._held.get((med, gi, h), 0) + 1
        bs = part.group.block_size
        for run in _runs(idx):
            a, b = run[0], run[-1] + 1
            self._out.append(
                BlockStored(
                    block_hashes=part.block_hashes[a:b],
                    parent_block_hash=part.block_hashes[a - 1] if a else part.parent,
                    token_ids=part.tokens[a * bs : b * bs].tolist(),
                    block_size=bs,
                    lora_id=c.lora_id,
                    medium=med,
                    lora_name=c.lora_name,
                    group_idx=part.group.index,
                    kv_cache_spec_kind=part.group.kind,
                    kv_cache_spec_sliding_window=part.group.window,
                )
            )

    def _release(self, c: _Chunk, med: str) -> list[tuple[_Part, list[Any]]]:
        """The blocks of ``c`` that leave tier ``med`` with it, per part."""
        out = []
        for part in c.parts:
            if part.group.role != WINDOW:
                out.append((part, list(part.block_hashes)))
                continue
            gone = []
            for h in part.block_hashes:
                k = (med, part.group.index, h)
                n = self._held.get(k, 0) - 1
                if n > 0:
                    self._held[k] = n
                else:
                    self._held.pop(k, None)
                    gone.append(h)
            if gone:
                out.append((part, gone))
        return out

    def take(self) -> list[KVCacheEvent]:
        out, self._out = self._out, []
        return out


def _runs(idx: Iterable[int]) -> list[list[int]]:
    """Consecutive runs of ascending indexes."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
