"""Tier orchestration: :class:`CacheEngine`.

``backends:`` is an ordered list of tiers, fastest first. Lookup returns the longest
contiguous prefix present in any tier; retrieve reads each chunk from the fastest
tier holding it and promotes it upward; store writes the first tier synchronously
and slower tiers in the background (write-through, bounded queues: a slow tier drops
writes rather than blocking the caller). Any backend exception is a miss.
A tier caught serving wrong KV by the correctness canary (:mod:`lmcache_core.canary`)
is quarantined (:mod:`lmcache_core.quarantine`): every read and write skips it.
Every chunk read and write goes through the tiers as this engine serves them
(:mod:`lmcache_core.tiers`: :class:`~lmcache_core.tiers.Tier`,
:class:`~lmcache_core.tiers.TierStack`), which the batched fetch and the canary share.

Chunks are addressed by prefix hash (the connector's scheduler hashes a prompt once);
tests and benchmarks that think in token ids use :mod:`lmcache_core.testing.tokens`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generator, Iterator, NamedTuple, Sequence

import torch

from . import metrics
from .backend import SHARED, BackendStats
from .canary import Canary
from .config import CoreConfig, LoadedConfig, read_frame_secret
from .fetch import fetch_run
from .keys import ChunkKey, KeyNamespace
from .lookup import first_held, lookup_runs
from .memory import MemoryBuffer
from .namespaces import NamespaceRecord, record_in_tiers
from .opening import Codecs, engine_config, engine_namespace, make_pool, open_tiers, say_how_frames_are_sealed
from .pins import ADDED, PinBook
from .plugins import PluginManager, get_plugin_manager
from .prefetch import Prefetcher
from .preload import Preloader, PreloadResult
from .control import EngineControl, memory_erase
from .quarantine import Quarantine
from .serde import FrameSeal
from .threads import enter_background, use_background_cores
from .tiers import ChunkData as ChunkData
from .tiers import ReadEstimate as ReadEstimate
from .tiers import TierEvent as TierEvent
from .tiers import TierListener as TierListener
from .tiers import Tier, TierStack

log = logging.getLogger(__name__)


#: bytes of prefetches in flight at most (see CacheEngine.prefetch), and at most
#: this share of the pool
PREFETCH_BYTES = 512 << 20
PREFETCH_POOL_SHARE = 0.5
#: how long a load waits for a running prefetch of the same run before reading it itself
PREFETCH_WAIT_S = 30.0
#: how long close() waits for running background reads (queued ones are cancelled)
CLOSE_WAIT_S = 5.0


class TierReport(NamedTuple):
    """One tier, as :meth:`CacheEngine.tier_report` reports it."""

    name: str
    #: keeps chunks in the memory pool (lent, not read)
    zero_copy: bool
    quarantined: bool
    stats: BackendStats | None


def _quarantine_gauge(tier: str, quarantined: bool) -> None:
    metrics.TIER_QUARANTINED.labels(tier).set(1 if quarantined else 0)


class CacheEngine:
    """Stores and retrieves KV chunks by prefix hash across the configured tiers."""

    #: the config's preload, once started (:meth:`preload`)
    preloader: Preloader | None = None

    def __init__(
        self,
        config: CoreConfig | LoadedConfig | None = None,
        *,
        namespace: KeyNamespace,
        plugins: PluginManager | None = None,
        shared_writes: bool = True,
    ) -> None:
        """``shared_writes=False``: this engine reads but never writes the tiers that
        declare ``SHARED`` (another engine writes the same keys there, e.g. rank 0
        when the KV is replicated across tensor-parallel ranks); its own tiers
        (the CPU tier) are still filled by stores and promotions."""
        self.plugins = plugins or get_plugin_manager()
        self.loaded = loaded = engine_config(config, self.plugins)
        self.config = cfg = loaded.config
        self.namespace = namespace = engine_namespace(namespace, cfg)
        #: the deployment's frame key (``frame_secret``); tiers get it through their
        #: codecs, so every frame they write is sealed and every frame they read must be
        self.seal = FrameSeal(secret) if (secret := read_frame_secret(cfg)) is not None else None
        codecs = Codecs(loaded, self.plugins, self.seal)
        self.codec, self.codecs = codecs.codec, codecs.by_name
        self.pool = make_pool(loaded, self.plugins)
        self.counters = metrics.EngineCounters()
        #: the open tiers and each one's codec (its section's ``serde``, else the
        #: top-level one; a lossy codec's frames satisfy only the tiers configured with it)
        self.tiers, self.tier_codecs = open_tiers(codecs, self.pool)
        say_how_frames_are_sealed(loaded, self.tiers, self.seal)
        self.quarantine = Quarantine(
            cfg.verify_mismatch_limit, cfg.verify_window_s, cfg.quarantine_dir, on_change=_quarantine_gauge
        )
        if cfg.background_cores != "auto":  # auto: the embedding decides (the vLLM connector, from the model's binding)
            use_background_cores(None if cfg.background_cores == "none" else cfg.background_cores)
        nice = functools.partial(enter_background, cfg.background_nice)
        #: the tiers as this engine serves them: reads, writes, promotion, write-behind
        writes = [shared_writes or SHARED not in t.capabilities for t in self.tiers]
        record_in_tiers(self.tiers, writes, NamespaceRecord.of(namespace, cfg.tenant))
        self.stack = TierStack(
            self.tiers,
            self.tier_codecs,
            writes,
            pool=self.pool,
            quarantine=self.quarantine,
            counters=self.counters,
            write_queue_size=cfg.write_queue_size,
            on_writer_start=nice,
        )
        #: the correctness canary: compares recomputed chunks with the tiers' copies
        self.canary = Canary(self.stack, namespace.id)
        self.stack.watch_promotions(self.canary.promoted)
        #: reads the next window of a long load while the caller copies this one
        self.fetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-fetch", initializer=nice)
        #: prefetches started at lookup (see prefetch), owned by the request's pin id
        self.prefetcher = Prefetcher(
            min(PREFETCH_BYTES, int(self.pool.capacity * PREFETCH_POOL_SHARE)), PREFETCH_WAIT_S, initializer=nice
        )
        #: every request's pins (lmcache_core.pins): a release also cancels the id's prefetch
        self.pins = PinBook(on_release=self.prefetcher.cancel)
        #: erase requests from `lmcache-core erase` reach the tiers in this engine's memory
        self.control = EngineControl(cfg.quarantine_dir, namespace.id, memory_erase(self.tiers, cfg.backends, self.plugins))
        self._closed = False

    # -- listeners --------------------------------------------------------------------
    def add_listener(self, listener: TierListener) -> None:
        """Call ``listener`` with a :class:`TierEvent` whenever a chunk reaches a tier
        (synchronous store, background write, promotion) or a tier evicts one. It runs
        on the thread that did the work, possibly under a tier's lock: it must be quick
        and must not call back into the engine. Exceptions are logged and ignored.

        The first listener subscribes the engine to every tier's evictions
        (:meth:`~lmcache_core.backend.StorageBackend.subscribe_evictions`): a tier that
        watches a server or polls nodes for them starts doing so only then."""
        self.stack.add_listener(listener)

    # -- keys -------------------------------------------------------------------------
    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def keys(self, hashes: Sequence[bytes]) -> list[ChunkKey]:
        ns = self.namespace.id
        return [ChunkKey(ns, h) for h in hashes]

    # -- lookup and pins --------------------------------------------------------------
    def lookup_hashes(
        self, hashes: Sequence[bytes], *, pin_id: str | None = None, record: bool = True, add_pins: bool = False
    ) -> int:
        """Number of leading chunks present; see :meth:`lookup_runs`."""
        return sum(n for _, n in self.lookup_runs(hashes, pin_id=pin_id, record=record, add_pins=add_pins))

    def lookup_runs(
        self, hashes: Sequence[bytes], *, pin_id: str | None = None, record: bool = True, add_pins: bool = False
    ) -> list[tuple[int, int]]:
        """The leading chunks some tier holds, as ``(tier index, chunks)`` runs in
        prefix order (so a caller can predict the load time); see
        :func:`lmcache_core.lookup.lookup_runs`. With ``pin_id`` the hits in pinning
        tiers are pinned until ``pins.release(pin_id)`` (:mod:`lmcache_core.pins`): a
        repeated lookup under the same id replaces the earlier pins, unless
        ``add_pins`` (an object probed next to a hit: pinned with it, released with
        it). With ``record=False`` the lookup is not counted (a caller that probes
        several times for one request counts once with :meth:`record_lookup`)."""
        if pin_id is not None and not add_pins:
            self.pins.begin(pin_id)
        keys = self.keys(hashes)

        def pin(tier: Tier, run: list[ChunkKey], pos: int) -> None:
            if pin_id is not None and tier.pinning:
                self.pins.take(pin_id, tier, run, ADDED if add_pins else pos)

        runs = lookup_runs(self.stack, keys, pin if pin_id is not None else None)
        if not add_pins:
            self.stack.hint(lambda tier: tier.hint_chain(keys))
        if record:
            self.record_lookup(len(keys), sum(n for _, n in runs))
        return runs

    def probe_boundary(self, hashes: Sequence[bytes], pin_id: str | None = None) -> int:
        """The index of the first of ``hashes`` (independent objects, in order of
        preference) some tier holds, or -1; one pass over the tiers
        (:func:`lmcache_core.lookup.first_held`). With ``pin_id`` the object found is
        pinned next to that id's hit (kept by ``pins.keep``, released with it)."""
        found = first_held(self.stack, self.keys(hashes))
        if found is None:
            return -1
        i, tier = found
        if pin_id is not None and tier.pinning:
            self.pins.take(pin_id, tier, self.keys([hashes[i]]), ADDED)
        return i

    def read_estimate(self, level: int, nbytes: int) -> ReadEstimate:
        """What reading ``nbytes`` of chunks from tier ``level`` (a run's level in
        :meth:`lookup_runs`) will cost, from its measured reads."""
        return self.stack.tiers[level].estimate(nbytes)

    def record_lookup(self, n_chunks: int, n_hit: int) -> None:
        """Count one lookup of ``n_chunks`` chunks of which ``n_hit`` were hits."""
        lookup_tokens, hit_tokens = n_chunks * self.chunk_size, n_hit * self.chunk_size
        self.counters.add(lookups=1, lookup_tokens=lookup_tokens, hit_tokens=hit_tokens)
        metrics.LOOKUPS.inc()
        metrics.LOOKUP_TOKENS.inc(lookup_tokens)
        metrics.HIT_TOKENS.inc(hit_tokens)

    def record_load_errors(self, n_chunks: int) -> None:
        """Count ``n_chunks`` chunks that were found but failed to load (recomputed)."""
        self.counters.add(load_errors=n_chunks)
        metrics.LOAD_ERRORS.inc(n_chunks)

    def retain(self, hashes: Sequence[bytes], seconds: float, priority: int = 0) -> int:
        """Retention hint (:mod:`lmcache_core.retention`): keep these chunks ahead of
        unretained ones for ``seconds`` in every tier that takes hints; chunks not
        there yet are retained when they arrive. How many resident chunks the first
        such tier now retains."""
        keys = self.keys(hashes)
        n = -1
        for tier in self.stack:
            got = tier.retain(keys, seconds, priority)
            if got is None:
                continue
            n = got if n < 0 else n
        return max(n, 0)

    # -- memory -----------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None:
        """A pool buffer for a chunk (evicting from the CPU tier if needed)."""
        return self.stack.allocate(shape, dtype)

    # -- store ------------------------------------------------------------------------
    def store_hashes(self, hashes: Sequence[bytes], chunks: Sequence[ChunkData], *, n_tokens: int | None = None) -> int:
        """Store chunks by prefix hash (:meth:`TierStack.store`); returns how many new
        chunks reached the first tier. ``n_tokens``: the tokens the chunks hold, when
        the last one is partial (a prompt's last, fewer tokens than ``chunk_size``)."""
        cs = self.chunk_size
        partial = n_tokens is not None and (len(hashes) - 1) * cs < n_tokens < len(hashes) * cs
        stored = self.stack.store(self.keys(hashes), chunks, partial)
        if self.stack.top is None or not self.stack.top.in_service:
            return stored
        toks = n_tokens if n_tokens is not None and stored == len(hashes) else stored * cs
        self.counters.add(stored_chunks=stored, stored_tokens=toks)
        metrics.STORED_TOKENS.inc(toks)
        return stored

    # -- retrieve ---------------------------------------------------------------------
    def retrieve_hashes(self, hashes: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        """Fill ``outs[i]`` with chunk ``hashes[i]`` for the leading chunks some tier
        holds; how many. Read through :meth:`iter_chunks`, the connector's read path
        (every ``outs[i]`` has the first one's dtype: ``ValueError`` otherwise)."""
        want = min(len(hashes), len(outs))
        if want and any(o.dtype != outs[0].dtype for o in outs[:want]):
            raise ValueError(f"retrieve_hashes: outs of several dtypes {sorted({str(o.dtype) for o in outs[:want]})}")
        n = 0
        if want:
            chunks = self.iter_chunks(hashes[:want], [tuple(o.shape) for o in outs[:want]], outs[0].dtype)
            try:
                for out, buf in zip(outs, chunks):
                    try:
                        out.copy_(buf.tensor)
                    finally:
                        buf.release()
                    n += 1
            finally:
                chunks.close()
        if n < want:
            self.record_load_errors(want - n)
        return n

    def retrieve_buffer(self, chunk_hash: bytes, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None:
        """One chunk as a pool buffer (the caller owns one reference), or ``None``
        on a miss: the read of one window of :meth:`iter_chunks` (zero-copy when the
        first tier keeps chunks in the pool)."""
        (buf,) = self.stack.read(self.keys([chunk_hash]), [tuple(shape)], dtype)
        if buf is not None:
            self.counters.add(retrieved_chunks=1)
        return buf

    def iter_chunks(
        self, hashes: Sequence[bytes], shapes: Sequence[Sequence[int]], dtype: torch.dtype
    ) -> Generator[MemoryBuffer, None, None]:
        """Chunks ``hashes[0], hashes[1], ...`` as pool buffers, in order, until the first
        one no tier holds (the caller releases each): the memory tier key by key, every
        other tier once per window of chunks (``get_many``: about one round trip on
        ``BATCHED`` tiers), the next window read while the caller copies this one.
        See :mod:`lmcache_core.fetch`."""
        if hashes:
            self.prefetcher.await_run(bytes(hashes[0]))
        return fetch_run(self.stack, self.keys(hashes), shapes, dtype, pool=self.fetch_pool)

    def prefetch(
        self, hashes: Sequence[bytes], shapes: Sequence[Sequence[int]], dtype: torch.dtype, owner: str | None = None
    ) -> bool:
        """Start reading ``hashes`` from the slower tiers into the memory tier in the
        background (a hit found at lookup, before vLLM schedules its load) for request
        ``owner`` (its pin id: releasing its pins cancels it), at most ``PREFETCH_BYTES``
        (and half the pool) in flight. False when nothing was started (no memory tier,
        the budget is taken, or the same run is already being read). A later
        :meth:`iter_chunks` of the same run waits for it if it is reading (bounded)
        instead of reading the chunks a second time, and cancels it if it is still
        queued (see :mod:`lmcache_core.prefetch`)."""
        tier0 = self.stack.top
        if not hashes or tier0 is None or not tier0.zero_copy or self._closed:
            return False
        item = torch.empty((), dtype=dtype).element_size()
        nbytes = sum(item * int(torch.Size(s).numel()) for s in shapes)
        keys, shapes = self.keys(hashes), list(shapes)

        def read() -> Iterator[None]:
            with torch.inference_mode():
                for buf in fetch_run(self.stack, keys, shapes, dtype):
                    buf.release()  # promoted into the memory tier by the read
                    yield None

        if not self.prefetcher.start(bytes(hashes[0]), nbytes, read, owner):
            return False
        self.counters.add(prefetches=1)
        return True

    def preload(
        self, dtype: torch.dtype, max_chunk_bytes: int, on_done: Callable[[PreloadResult], None] | None = None
    ) -> PreloadResult | None:
        """Start the config's ``preload`` (:mod:`lmcache_core.preload`): this namespace's
        chunks of ``dtype`` and at most ``max_chunk_bytes`` each (one whole chunk, as
        the caller loads them) from the slower tiers into the memory tier, in the
        background; ``on_done(result)`` at its end. Its result (filled as it runs;
        ``stopped`` says when it is over), or None when the config asks for none or
        one was started already."""
        if self.config.preload <= 0 or self.preloader is not None or self._closed:
            return None
        self.preloader = Preloader(
            self.stack,
            self.namespace.id,
            dtype,
            max_chunk_bytes,
            self.config.preload,
            initializer=functools.partial(enter_background, self.config.background_nice),
            on_done=on_done,
        )
        self.preloader.start()
        return self.preloader.result

    # -- housekeeping -----------------------------------------------------------------
    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until background writes are done; False on timeout."""
        return self.stack.flush(timeout)

    def tier_report(self) -> list[TierReport]:
        """Each tier's name, kind (zero-copy), quarantine and current stats (None when
        asking it failed): what a caller reports without holding the tiers."""
        out = []
        for t in self.stack:
            try:
                stats: BackendStats | None = t.backend.stats()
            except Exception:  # a broken tier reports nothing this time
                stats = None
            out.append(TierReport(t.name, t.zero_copy, not t.in_service, stats))
        return out

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.counters.snapshot())
        tiers = []
        for t in self.tiers:
            try:
                tiers.append(dataclasses.asdict(t.stats()))
            except Exception as err:
                tiers.append({"name": t.name, "error": str(err)})
        out["tiers"] = tiers
        out["quarantined"] = self.quarantine.quarantined()
        out["pool"] = {"capacity": self.pool.capacity, "used": self.pool.used, "populated": self.pool.populated_bytes}
        out["frame_key_id"] = self.seal.key_id if self.seal is not None else None  # frames sealed (frame_secret)
        if self.preloader is not None:
            out["preload"] = self.preloader.result.as_dict()
        return out

    def close(self) -> None:
        """Stop background work and close the tiers, in bounded time: queued
        prefetches and background writes are dropped, running ones get at most
        ``CLOSE_WAIT_S`` together (a tier call in progress is not interrupted: its
        thread is left to finish on its own), then each tier's ``close``."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + CLOSE_WAIT_S
        self.prefetcher.close(CLOSE_WAIT_S)
        if self.preloader is not None:
            self.preloader.close(max(0.0, deadline - time.monotonic()))
        self.fetch_pool.shutdown(wait=False, cancel_futures=True)
        self.pool.stop_populate()
        self.quarantine.close()
        self.control.close()
        self.stack.close(deadline)

    def __enter__(self) -> "CacheEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
