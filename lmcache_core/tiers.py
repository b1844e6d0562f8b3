"""The tiers as this engine serves them: :class:`Tier` and :class:`TierStack`.

A :class:`Tier` is one configured backend plus what the engine adds around every
call to it: whether it is in service (not quarantined by the canary) and whether
this engine writes it, its codec, its measured read cost, the checks on what it
answers (shape, dtype, batch length), failures counted as misses, and the per-tier
metrics. Every chunk the engine, the batched fetch (:mod:`lmcache_core.fetch`) and
the canary (:mod:`lmcache_core.canary`) read or write goes through one of its
methods: :meth:`Tier.lend` (a zero-copy tier's own buffer), :meth:`Tier.read_many`
(copied into the caller's tensors), :meth:`Tier.put`, :meth:`Tier.put_many` (the
background writers' batches) and :meth:`Tier.replace`; lookups, pins and hints go
through :meth:`Tier.contains`, :meth:`Tier.pin` / :meth:`Tier.unpin`,
:meth:`Tier.retain` and :meth:`Tier.attempt`.

A :class:`TierStack` is the ordered tiers, fastest first: the one read path
(:meth:`TierStack.read`: the memory tier lent key by key, every other tier once per
batch, the leading run promoted), the promotion rule (a lossy tier's chunk goes only
where that codec is), pool buffers, the background writers (write-behind), hints, and
the tier events listeners are told of.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, NamedTuple, Sequence

import torch

from . import metrics
from .backend import PINNING, SHARED, ZERO_COPY, StorageBackend
from .keys import ChunkKey
from .loadcost import TierReadModel
from .memory import MemoryBuffer, MemoryPool
from .quarantine import Quarantine
from .serde import Codec, is_lossy
from .writeback import TierWriter

log = logging.getLogger(__name__)

ChunkData = torch.Tensor | MemoryBuffer


@dataclass(frozen=True)
class ReadEstimate:
    """What reading ``nbytes`` of chunks from one tier will cost, as a load is planned.
    ``seconds`` fits the tier's read model when asked (a least-squares fit after every
    new sample), so a caller that stops at ``zero_copy`` or a stale ``age`` pays nothing."""

    #: the tier keeps chunks in the pool: a load is lent them, nothing is read
    zero_copy: bool
    #: seconds since the tier's last measured read (None: never)
    age: float | None
    model: TierReadModel = field(repr=False)
    nbytes: int

    @property
    def seconds(self) -> float | None:
        """Predicted seconds to read ``nbytes`` (None: never measured)."""
        return self.model.predict(self.nbytes)


class TierEvent(NamedTuple):
    """What a tier now holds or dropped: ``stored`` (a chunk reached the tier) or
    ``evicted`` (the tier dropped it to make room). ``tier`` is the tier's name."""

    kind: Literal["stored", "evicted"]
    tier: str
    key: ChunkKey


TierListener = Callable[[TierEvent], None]


def _tensor(data: ChunkData) -> torch.Tensor:
    return data.tensor if isinstance(data, MemoryBuffer) else data


class Tier:
    """One backend as this engine serves it (``level``: its place in the stack, 0 the
    fastest). Backend exceptions never leave its methods: they are logged, counted
    (``lmcache_core:tier_errors_total{tier,op}``) and answered as a miss."""

    def __init__(
        self,
        backend: StorageBackend,
        level: int,
        codec: Codec,
        *,
        writes: bool,
        quarantine: Quarantine,
        counters: metrics.EngineCounters,
        on_stored: Callable[[Tier, ChunkKey], None],
    ) -> None:
        """``writes=False``: this engine never writes the tier (a ``SHARED`` tier
        another engine fills)."""
        self.backend = backend
        self.level = level
        self.name = backend.name
        #: the tier's codec (its section's ``serde``, else the top-level one)
        self.codec = codec
        self.writes = writes
        self.zero_copy = ZERO_COPY in backend.capabilities
        self.pinning = PINNING in backend.capabilities
        self.shared = SHARED in backend.capabilities
        #: read latency/throughput, measured on every successful read (load policies)
        self.read_model = TierReadModel()
        self.quarantine = quarantine
        self.counters = counters
        self.on_stored = on_stored

    def __repr__(self) -> str:
        return f"Tier({self.level}: {self.name})"

    def estimate(self, nbytes: int) -> ReadEstimate:
        """What reading ``nbytes`` of chunks from this tier will cost (its measured reads)."""
        return ReadEstimate(self.zero_copy, self.read_model.fit.age(), self.read_model, nbytes)

    @property
    def in_service(self) -> bool:
        """False while the tier is quarantined: no reads, no writes."""
        return not self.quarantine.is_quarantined(self.name)

    @property
    def writable(self) -> bool:
        """Whether this engine writes the tier now (in service, not another's)."""
        return self.writes and self.in_service

    def error(self, op: str, err: BaseException) -> None:
        """Count a failed backend call ``op``; the caller treats it as a miss."""
        log.warning("tier %s: %s failed, treated as a miss: %s: %s", self.name, op, type(err).__name__, err)
        self.counters.error(self.name)
        metrics.labeled(metrics.TIER_ERRORS, self.name, op).inc()

    def attempt(self, op: str, call: Callable[[StorageBackend], object]) -> bool:
        """Run ``call(backend)`` (a pin, a hint, a retention call); False if it
        raised (counted as an error of ``op``)."""
        try:
            call(self.backend)
        except Exception as err:
            self.error(op, err)
            return False
        return True

    def contains(self, keys: Sequence[ChunkKey]) -> int | None:
        """How many leading ``keys`` the tier holds (at most ``len(keys)``); None when
        asking failed."""
        try:
            return min(self.backend.contains(keys), len(keys))
        except Exception as err:
            self.error("contains", err)
            return None

    def held(self, keys: Sequence[ChunkKey]) -> int | None:
        """The index of the first of ``keys`` the tier holds, each key on its own
        (:meth:`~lmcache_core.backend.StorageBackend.first_held`); None when it holds
        none or asking failed."""
        try:
            i = self.backend.first_held(keys)
        except Exception as err:
            self.error("contains", err)
            return None
        return i if 0 <= i < len(keys) else None

    def holds(self, key: ChunkKey) -> bool:
        """Whether the tier holds ``key`` (False when asking fails)."""
        return bool(self.contains([key]))

    def pin(self, keys: Sequence[ChunkKey]) -> bool:
        """Pin ``keys`` against eviction; False if the tier failed to."""
        return self.attempt("pin", lambda b: b.pin(keys))

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self.attempt("unpin", lambda b: b.unpin(keys))

    def retain(self, keys: Sequence[ChunkKey], seconds: float, priority: int) -> int | None:
        """A retention hint (:meth:`StorageBackend.retain`): how many of ``keys`` the
        tier now retains, or None when it failed."""
        try:
            return self.backend.retain(keys, seconds, priority)
        except Exception as err:
            self.error("retain", err)
            return None

    # -- reads ------------------------------------------------------------------------
    def lend(self, key: ChunkKey, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None:
        """A zero-copy tier's own buffer for ``key`` (one reference for the caller), or
        None on a miss or a chunk of another shape or dtype (counted as an error)."""
        t0 = time.perf_counter()
        try:
            buf = self.backend.get_buffer(key)
        except Exception as err:
            self.error("get", err)
            return None
        if buf is None:
            return None
        if buf.dtype == dtype and buf.shape == tuple(shape):
            self.read_model.record(buf.nbytes, time.perf_counter() - t0)
            metrics.labeled(metrics.TIER_BYTES, self.name, "get").inc(buf.nbytes)
            return buf
        buf.release()
        self.error("get", ValueError(f"stored chunk has shape {list(buf.shape)}, expected {list(shape)}"))
        return None

    def read_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``outs[i]`` with ``keys[i]``'s chunk in one ``get_many`` (one round trip
        on a ``BATCHED`` tier); per key, whether it was read. A failed or malformed
        answer is a miss for the whole batch."""
        t0 = time.perf_counter()
        try:
            ok = self.backend.get_many(keys, outs)
            if len(ok) != len(keys):
                raise ValueError(f"get_many answered {len(ok)} results for {len(keys)} keys")
        except Exception as err:
            self.error("get", err)
            ok = [False] * len(keys)
        dt = time.perf_counter() - t0
        metrics.labeled(metrics.TIER_LATENCY, self.name, "get").observe(dt)
        hit_bytes = sum(o.nbytes for o, h in zip(outs, ok) if h)
        if hit_bytes:
            self.read_model.record(hit_bytes, dt)
            metrics.labeled(metrics.TIER_BYTES, self.name, "get").inc(hit_bytes)
        return ok

    # -- writes -----------------------------------------------------------------------
    def _put_one(self, key: ChunkKey, data: ChunkData) -> bool:
        if isinstance(data, MemoryBuffer) and self.zero_copy:
            return self.backend.put_buffer(key, data)  # adopted, not copied
        return self.backend.put(key, _tensor(data))

    def _written(self, key: ChunkKey, nbytes: int) -> None:
        metrics.labeled(metrics.TIER_BYTES, self.name, "put").inc(nbytes)
        self.on_stored(self, key)

    def put(self, key: ChunkKey, data: ChunkData) -> bool:
        """Store one chunk now (a zero-copy tier adopts a pool buffer); whether it
        was stored. Nothing is written to a tier this engine does not write."""
        if not self.writable:
            return False
        t0 = time.perf_counter()
        try:
            ok = self._put_one(key, data)
        except Exception as err:
            self.error("put", err)
            ok = False
        metrics.labeled(metrics.TIER_LATENCY, self.name, "put").observe(time.perf_counter() - t0)
        if ok:
            self._written(key, data.nbytes)
        return ok

    def put_many(self, batch: Sequence[tuple[ChunkKey, MemoryBuffer]]) -> None:
        """Store a background writer's batch in one ``put_many``; a chunk the tier
        declined is counted as dropped. Skipped when the tier left service while the
        batch was queued."""
        t0 = time.perf_counter()
        try:
            if not self.in_service:
                return
            ok = self.backend.put_many([(key, buf.tensor) for key, buf in batch])
            if len(ok) != len(batch):
                raise ValueError(f"put_many answered {len(ok)} results for {len(batch)} chunks")
            for (key, buf), stored in zip(batch, ok):
                if stored:
                    self._written(key, buf.nbytes)
                else:
                    metrics.labeled(metrics.TIER_DROPPED, self.name).inc()
        except Exception as err:
            log.warning("tier %s: background put of %d chunks failed: %s", self.name, len(batch), err)
            self.counters.error(self.name)
            metrics.labeled(metrics.TIER_ERRORS, self.name, "put").inc()
        finally:
            metrics.labeled(metrics.TIER_LATENCY, self.name, "put").observe(time.perf_counter() - t0)

    def replace(self, key: ChunkKey, data: ChunkData) -> None:
        """Overwrite ``key``'s object with ``data`` (the canary's repair), unless the
        tier is out of service or not this engine's to write."""
        if not self.writable:
            return
        try:
            self.backend.remove(key)
            self._put_one(key, data)
        except Exception as err:
            self.error("put", err)


class TierStack:
    """The engine's tiers, fastest first, and the rules between them: reads from the
    fastest tier holding a chunk, promotion upward, write-behind to the slower tiers
    on background writers (:class:`~lmcache_core.writeback.TierWriter`)."""

    def __init__(
        self,
        backends: Sequence[StorageBackend],
        codecs: Sequence[Codec],
        writes: Sequence[bool],
        *,
        pool: MemoryPool,
        quarantine: Quarantine,
        counters: metrics.EngineCounters,
        write_queue_size: int,
        on_writer_start: Callable[[], None] = lambda: None,
    ) -> None:
        self.pool = pool
        self.quarantine = quarantine
        self.counters = counters
        self.tiers = [
            Tier(b, i, c, writes=w, quarantine=quarantine, counters=counters, on_stored=self._stored)
            for i, (b, c, w) in enumerate(zip(backends, codecs, writes))
        ]
        self.listeners: list[TierListener] = []
        self.promotion_watchers: list[Callable[[ChunkKey, str], None]] = []
        #: one background writer per tier below the first
        self.writers = [
            TierWriter(t.name, int(t.backend.write_concurrency), write_queue_size, counters, t.put_many, on_writer_start)
            for t in self.tiers[1:]
        ]

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    @property
    def top(self) -> Tier | None:
        """The fastest tier (None when no tier is configured)."""
        return self.tiers[0] if self.tiers else None

    # -- events -----------------------------------------------------------------------
    def add_listener(self, listener: TierListener) -> None:
        """See :meth:`CacheEngine.add_listener`; the first listener subscribes the
        stack to every tier's evictions."""
        first = not self.listeners
        self.listeners.append(listener)
        if first:
            for tier in self.tiers:
                tier.backend.subscribe_evictions(functools.partial(self._evicted, tier))

    def watch_promotions(self, watcher: Callable[[ChunkKey, str], None]) -> None:
        """Call ``watcher(key, origin tier name)`` whenever a chunk is promoted."""
        self.promotion_watchers.append(watcher)

    def _evicted(self, tier: Tier, key: ChunkKey) -> None:
        self._emit(TierEvent("evicted", tier.name, key))

    def _stored(self, tier: Tier, key: ChunkKey) -> None:
        if self.listeners:
            self._emit(TierEvent("stored", tier.name, key))

    def _emit(self, event: TierEvent) -> None:
        for fn in self.listeners:
            try:
                fn(event)
            except Exception as err:
                log.warning("tier listener failed on %s: %s: %s", event.kind, type(err).__name__, err)

    # -- memory -----------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None:
        """A pool buffer for a chunk (evicting from the zero-copy first tier if needed)."""
        buf = self.pool.allocate(shape, dtype)
        top = self.top
        if buf is None and top is not None and top.zero_copy:
            while buf is None and top.backend.evict_for(1):
                buf = self.pool.allocate(shape, dtype)
        return buf

    # -- reads ------------------------------------------------------------------------
    def read(self, keys: Sequence[ChunkKey], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[MemoryBuffer | None]:
        """Chunk ``keys[i]`` as a pool buffer (the caller owns one reference), or None
        where no tier holds it (or the pool is full); only the leading run is kept
        (keys chain: a chunk after a gap can never be looked up without it), and what
        a slower tier served in it is promoted."""
        n = len(keys)
        got: list[MemoryBuffer | None] = [None] * n
        top = self.top
        lent = top is not None and top.zero_copy and top.in_service
        if lent and top is not None:
            for i, key in enumerate(keys):
                got[i] = top.lend(key, shapes[i], dtype)
        level_of = self._read_missing(keys, shapes, dtype, got, start=1 if lent else 0)
        lead = 0
        while lead < n and got[lead] is not None:
            lead += 1
        for i in range(lead, n):
            buf = got[i]
            if buf is not None:
                buf.release()
                got[i] = None
        for i in range(lead):
            level, buf = level_of.get(i, 0), got[i]
            if level > 0 and buf is not None:
                self.promote(keys[i], buf, self.tiers[level])
        return got

    def _read_missing(
        self,
        keys: Sequence[ChunkKey],
        shapes: Sequence[tuple[int, ...]],
        dtype: torch.dtype,
        got: list[MemoryBuffer | None],
        start: int,
    ) -> dict[int, int]:
        """Fill the gaps of ``got`` from tiers ``start`` on, one batch per tier, into
        fresh pool buffers; returns the level that served each filled position."""
        missing = [i for i in range(len(keys)) if got[i] is None]
        spare: dict[int, MemoryBuffer] = {}
        for i in missing:
            buf = self.allocate(shapes[i], dtype)
            if buf is None:  # the pool is full: what follows is recomputed
                break
            spare[i] = buf
        missing = [i for i in missing if i in spare]
        level_of: dict[int, int] = {}
        try:
            for tier in self.tiers[start:]:
                if not missing:
                    break
                if not tier.in_service:
                    continue
                ok = tier.read_many([keys[i] for i in missing], [spare[i].tensor for i in missing])
                still = []
                for i, hit in zip(missing, ok):
                    if hit:
                        got[i] = spare.pop(i)
                        level_of[i] = tier.level
                    else:
                        still.append(i)
                missing = still
        finally:
            for buf in spare.values():
                buf.release()
        return level_of

    def read_from(self, tier: Tier, key: ChunkKey, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None:
        """``key``'s object in ``tier`` alone, as a pool buffer (the caller releases
        it), without promotion: a zero-copy tier lends its own; None on a miss."""
        if tier.zero_copy:
            return tier.lend(key, shape, dtype)
        buf = self.allocate(tuple(shape), dtype)
        if buf is None:
            return None
        if tier.read_many([key], [buf.tensor])[0]:
            return buf
        buf.release()
        return None

    # -- promotion and write-behind ---------------------------------------------------
    def takes_from(self, dest: Tier, source: Tier) -> bool:
        """Whether a chunk read from ``source`` may be promoted into ``dest``. A lossy
        tier's chunk is an approximation: it goes only into tiers with that same
        codec, and into tier 0 when that is this engine's own memory (not shared),
        never into a lossless tier other readers take for exact KV."""
        codec = source.codec
        if not is_lossy(codec) or dest.codec.name == codec.name:
            return True
        return dest.level == 0 and not dest.shared

    def promote(self, key: ChunkKey, data: ChunkData, source: Tier) -> None:
        """``key``'s chunk was read from ``source``: copy it into the faster tiers
        that may take it (the first one now, the others behind)."""
        for watch in self.promotion_watchers:
            watch(key, source.name)
        top = self.tiers[0]
        if top.in_service and self.takes_from(top, source):
            top.put(key, data)
        if source.level > 1:
            self.write_behind(key, data, upto=source.level, source=source)

    def write_behind(self, key: ChunkKey, data: ChunkData, upto: int | None = None, source: Tier | None = None) -> None:
        """Queue ``data`` for the slower tiers (all, or those above level ``upto``;
        for a promotion from ``source``, those that may take its chunk)."""
        buf: MemoryBuffer | None
        if isinstance(data, MemoryBuffer):
            buf = data.retain()
        else:
            buf = self.allocate(tuple(data.shape), data.dtype)
            if buf is None:
                self.counters.add(dropped_writes=len(self.writers))
                return
            buf.tensor.copy_(data)
        try:
            for tier, writer in zip(self.tiers[1:], self.writers):
                if (upto is None or tier.level < upto) and tier.writable:
                    if source is None or self.takes_from(tier, source):
                        writer.submit(key, buf)
        finally:
            buf.release()

    def store(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData], partial_last: bool = False) -> int:
        """Write chunks to the first tier now and queue them for the slower ones; how
        many new chunks reached the first tier. A chunk the first tier already holds
        is skipped entirely, slower tiers included (a write a slow tier dropped
        earlier is not retried: it is a cache). ``partial_last``: the last chunk is a
        prompt's partial tail (hinted to the first tier's eviction order)."""
        top = self.top
        if top is None:
            return 0
        if not top.in_service:
            for key, data in zip(keys, chunks):
                if self.writers:
                    self.write_behind(key, data)
            return 0
        stored = 0
        for i, (key, data) in enumerate(zip(keys, chunks)):
            if top.contains([key]):
                continue  # already cached (another request stored it): no rewrite
            buf, owned = self._staged(top, data)
            try:
                ok = top.put(key, data if buf is None else buf)
                stored += ok
                if ok and partial_last and i == len(keys) - 1:
                    self.hint(lambda tier: tier.hint_partial(key), (top,))
                if self.writers:
                    self.write_behind(key, data if buf is None else buf)
            finally:
                if owned and buf is not None:
                    buf.release()
        return stored

    def _staged(self, top: Tier, data: ChunkData) -> tuple[MemoryBuffer | None, bool]:
        """``data`` as a pool buffer when the first tier adopts buffers (copied once
        into the pool: the first tier adopts it, write-behind shares it), and whether
        the caller owns that buffer's reference."""
        if isinstance(data, MemoryBuffer):
            return data, False
        if not top.zero_copy:
            return None, False
        buf = self.allocate(tuple(data.shape), data.dtype)
        if buf is not None:
            buf.tensor.copy_(data)
        return buf, True

    def hint(self, call: Callable[[StorageBackend], None], tiers: Sequence[Tier] | None = None) -> None:
        """Pass an eviction-order hint (``StorageBackend.hint_chain`` /
        ``hint_partial``) to the in-service tiers; a tier that fails is counted and
        otherwise ignored (a hint, not a request)."""
        for tier in self.tiers if tiers is None else tiers:
            if tier.in_service:
                tier.attempt("hint", call)

    # -- housekeeping -----------------------------------------------------------------
    def flush(self, timeout: float | None) -> bool:
        """Wait until background writes are done; False on timeout."""
        return all(w.flush(timeout) for w in self.writers)

    def close(self, deadline: float) -> None:
        """Drop queued writes, give running ones until ``deadline``
        (``time.monotonic()``), then close every tier."""
        for w in self.writers:
            w.stop(timeout=max(0.1, deadline - time.monotonic()))
        for t in self.tiers:
            try:
                t.backend.close()
            except Exception as err:
                log.warning("tier %s: close failed: %s", t.name, err)
