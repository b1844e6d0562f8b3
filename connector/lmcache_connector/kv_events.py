"""KV-cache events for cache-aware routers: what lmcache-core's tiers hold, in vLLM's
event format (``BlockStored`` / ``BlockRemoved``), published by vLLM's own publisher
(``--kv-events-config``) next to vLLM's GPU-cache events.

Path: each worker's :class:`~lmcache_core.engine.CacheEngine` reports every chunk
that reaches a tier and every chunk a tier evicts (a core listener); the worker ships
them once per step (``get_kv_connector_kv_cache_events``); vLLM merges the ranks'
batches and hands them to the scheduler (``update_connector_output``), which knows
the vLLM block hashes of the chunks it asked to save and turns them into events
(``take_events``). One chunk is ``chunk_size / block_size`` vLLM blocks.

``medium`` names the tier: ``lmcache:<tier name>`` (``lmcache:local_cpu``,
``lmcache:disk``, ...). Under tensor parallelism a chunk counts as stored in a tier
once every rank that writes it has stored its shard there (a hit needs them all),
and as removed as soon as one rank evicts it.

Bounds: the scheduler remembers at most ``max_chunks`` chunks (oldest forgotten
first; an eviction of a forgotten chunk is not announced), and each worker buffers
at most ``MAX_PENDING`` events between steps (the excess is dropped and counted).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from lmcache_core.engine import TierEvent

from .log import get_logger

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


@dataclass
class _Chunk:
    block_hashes: list[Any]
    parent: Any
    tokens: array
    block_size: int
    lora_name: str | None
    lora_id: int | None
    reported: dict[str, set[int]] = field(default_factory=dict)  # medium -> ranks holding it
    announced: set[str] = field(default_factory=set)


class EventTranslator:
    """Scheduler side: remembers the vLLM block hashes of chunks being saved and turns
    the workers' tier events into vLLM events."""

    def __init__(
        self, *, chunk_size: int, hash_block_size: int, writers: Sequence[int], max_chunks: int = DEFAULT_MAX_CHUNKS
    ) -> None:
        """``writers``: the ranks that store each chunk (all of them, or rank 0 alone
        when the KV is replicated across ranks)."""
        self.cs = chunk_size
        self.hbs = hash_block_size
        self.writers = frozenset(writers)
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._out: list[KVCacheEvent] = []
        self.unknown = 0  # events about chunks not (or no longer) remembered

    def remember(self, request: Any, chunk: int, chunk_hash: bytes, end: int) -> None:
        """Chunk ``chunk`` (tokens up to ``end``) of ``request`` is about to be saved."""
        if chunk_hash in self._chunks:
            self._chunks.move_to_end(chunk_hash)
            return
        b0, b1 = chunk * self.cs // self.hbs, end // self.hbs
        hashes = list(getattr(request, "block_hashes", None) or [])[b0:b1]
        if b1 <= b0 or len(hashes) < b1 - b0:
            return  # a partial chunk with no full vLLM block, or hashes not computed yet
        lora = getattr(request, "lora_request", None)
        self._chunks[chunk_hash] = _Chunk(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes],
            parent=maybe_convert_block_hash(request.block_hashes[b0 - 1]) if b0 else None,
            tokens=array("q", request.all_token_ids[b0 * self.hbs : b1 * self.hbs]),
            block_size=self.hbs,
            lora_name=lora.lora_name if lora else None,
            lora_id=lora.lora_int_id if lora else None,
        )
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)

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
                    self._out.append(
                        BlockStored(
                            block_hashes=list(c.block_hashes),
                            parent_block_hash=c.parent,
                            token_ids=c.tokens.tolist(),
                            block_size=c.block_size,
                            lora_id=c.lora_id,
                            medium=med,
                            lora_name=c.lora_name,
                        )
                    )
            elif kind == "evicted":
                held.discard(rank)
                if med in c.announced:
                    c.announced.discard(med)
                    self._out.append(BlockRemoved(block_hashes=list(c.block_hashes), medium=med))

    def take(self) -> list[KVCacheEvent]:
        out, self._out = self._out, []
        return out
