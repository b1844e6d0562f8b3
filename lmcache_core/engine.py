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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generator, Iterator, Mapping, Sequence, overload

import torch

from . import metrics
from .backend import SHARED, ZERO_COPY, BackendContext, StorageBackend
from .canary import Canary
from .config import ConfigError, CoreConfig, LoadedConfig, load_config, read_frame_secret
from .fetch import fetch_run
from .keys import ChunkKey, KeyNamespace
from .memory import MemoryBuffer, MemoryPool, available_memory
from .plugins import PluginManager, get_plugin_manager
from .prefetch import Prefetcher
from .quarantine import Quarantine
from .serde import Codec, FrameSeal, SealedCodec, SealedCodecs, is_lossy, tier_codecs
from .threads import enter_background, use_background_cores
from .tiers import ChunkData as ChunkData
from .tiers import Tier, TierStack
from .tiers import TierEvent as TierEvent
from .tiers import TierListener as TierListener

log = logging.getLogger(__name__)


#: keys in a tier's lookup window after it answered short of its window (see lookup_runs)
LOOKUP_WINDOW = 16
#: bytes of prefetches in flight at most (see CacheEngine.prefetch), and at most
#: this share of the pool
PREFETCH_BYTES = 512 << 20
PREFETCH_POOL_SHARE = 0.5
#: how long a load waits for a running prefetch of the same run before reading it itself
PREFETCH_WAIT_S = 30.0
#: how long close() waits for running background reads (queued ones are cancelled)
CLOSE_WAIT_S = 5.0


class KeyWindow(Sequence[ChunkKey]):
    """``keys[start:stop]`` as a read-only sequence that copies nothing: what a tier's
    ``contains`` gets from a lookup. Iterating it touches only the keys the tier
    reads, so a tier that stops at its first miss costs its hits plus one."""

    __slots__ = ("_keys", "_start", "_stop")

    def __init__(self, keys: Sequence[ChunkKey], start: int, stop: int) -> None:
        self._keys, self._start, self._stop = keys, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, i: int) -> ChunkKey: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ChunkKey]: ...

    def __getitem__(self, i: int | slice) -> ChunkKey | Sequence[ChunkKey]:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self._stop - self._start)
            if step == 1:
                return KeyWindow(self._keys, self._start + lo, self._start + max(lo, hi))
            return [self._keys[self._start + j] for j in range(lo, hi, step)]
        n = self._stop - self._start
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("key window index out of range")
        return self._keys[self._start + i]

    def __iter__(self) -> Iterator[ChunkKey]:
        return map(self._keys.__getitem__, range(self._start, self._stop))

    def __repr__(self) -> str:
        return f"KeyWindow({self._start}:{self._stop} of {len(self._keys)})"


def _quarantine_gauge(tier: str, quarantined: bool) -> None:
    metrics.TIER_QUARANTINED.labels(tier).set(1 if quarantined else 0)


def _pool_claims(loaded: LoadedConfig, plugins: PluginManager) -> list[tuple[int, int]]:
    """``(index in backends, bytes)`` for every configured tier that declares pool
    memory (``pool_bytes`` at registration: tiers that keep their chunks in the pool,
    like ``local_cpu`` or a third-party zero-copy tier); a size that does not parse is
    a :class:`ConfigError` naming its key and file."""
    source = loaded.source_of("backends")
    claims = [(i, plugins.pool_bytes(b, key_path=f"backends[{i}]", source=source)) for i, b in enumerate(loaded.config.backends)]
    return [(i, n) for i, n in claims if n > 0]


def _make_pool(loaded: LoadedConfig, plugins: PluginManager) -> MemoryPool:
    """The pool holds what the tiers declare plus ``staging_size`` of headroom for
    chunks in flight (gathered for a save, queued for a slower tier, read from one
    for a load), so a full CPU tier never starves the transfers to and from slower
    tiers. When the machine cannot hold it: a :class:`ConfigError` naming the
    sections that size it (rather than an allocator error naming no key, or the OOM
    killer later)."""
    cfg = loaded.config
    claims = _pool_claims(loaded, plugins)
    size = max(sum(n for _, n in claims) + cfg.staging_size, 1 << 20)
    avail = available_memory()
    if avail is None or size <= avail:
        try:
            return MemoryPool(size, populate=cfg.populate_pool)
        except (RuntimeError, MemoryError) as err:
            reason = f"allocating it failed: {err}"
    else:
        reason = f"only {avail / 2**30:.1f} GiB of memory is available on this machine"
    keys = [f"backends[{i}] ({cfg.backends[i].name}: {n / 2**30:.1f} GiB)" for i, n in claims]
    raise ConfigError(
        f"{' + '.join(keys + ['staging_size'])}: the CPU memory pool would be {size / 2**30:.1f} GiB but {reason}; "
        f"lower them (backends from {loaded.source_of('backends')}, staging_size from {loaded.source_of('staging_size')})"
    )


def _log_namespace(namespace: KeyNamespace) -> None:
    # the id to give `lmcache-core erase --namespace` (keys carry only this hash)
    log.info(
        "key namespace %s (model %s, rank %d of %d, tenant salt %s)",
        namespace.id.hex(),
        namespace.model,
        namespace.rank,
        namespace.world_size,
        "set" if namespace.salt is not None else "none",
    )


class CacheEngine:
    """Stores and retrieves KV chunks by token ids across the configured tiers."""

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
        loaded = config if isinstance(config, LoadedConfig) else (LoadedConfig(config) if config is not None else load_config())
        self.loaded = loaded
        self.config = cfg = loaded.config
        if cfg.tenant_salt is not None:
            namespace = dataclasses.replace(namespace, salt=cfg.tenant_salt)
        self.namespace = namespace
        self._ns_id = namespace.id
        _log_namespace(namespace)
        self.plugins = plugins or get_plugin_manager()
        secret = read_frame_secret(cfg)
        #: the deployment's frame key (``frame_secret``); tiers get it through
        #: ``codec`` / ``codecs``, so every frame they write is sealed and every
        #: frame they read must be
        self.seal = FrameSeal(secret) if secret is not None else None
        self.codec, self.codecs = self._sealed_codecs(loaded)
        #: each tier's codec (its section's ``serde``, else the top-level one); a
        #: lossy codec's frames satisfy only the tiers configured with it
        self.tier_codecs: list[Codec] = []
        self.pool = _make_pool(loaded, self.plugins)
        self.counters = metrics.EngineCounters()
        self.tiers: list[StorageBackend] = []
        self._open_tiers(loaded)
        self._say_how_frames_are_sealed(loaded)
        self.quarantine = Quarantine(
            cfg.verify_mismatch_limit, cfg.verify_window_s, cfg.quarantine_dir, on_change=_quarantine_gauge
        )
        if cfg.background_cores != "auto":  # auto: the embedding decides (the vLLM connector, from the model's binding)
            use_background_cores(None if cfg.background_cores == "none" else cfg.background_cores)
        nice = functools.partial(enter_background, cfg.background_nice)
        #: the tiers as this engine serves them: reads, writes, promotion, write-behind
        self.stack = self._serve_tiers(shared_writes, nice)
        #: the correctness canary: compares recomputed chunks with the tiers' copies
        self.canary = Canary(self.stack, namespace.id)
        self.stack.watch_promotions(self.canary.promoted)
        # read latency/throughput per tier, measured on every successful read (load policies)
        self.read_models = [t.read_model for t in self.stack]
        # pin id -> (tier, keys pinned there, position of the first key in the lookup;
        # -1: an object pinned next to the hit with add_pins)
        self._pins: dict[str, list[tuple[Tier, list[ChunkKey], int]]] = {}
        self._pin_lock = threading.Lock()
        # reads the next window of a long load while the caller copies this one
        self._fetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-fetch", initializer=nice)
        # prefetches started at lookup (see prefetch), owned by the request's pin id
        budget = min(PREFETCH_BYTES, int(self.pool.capacity * PREFETCH_POOL_SHARE))
        self.prefetcher = Prefetcher(budget, PREFETCH_WAIT_S, initializer=nice)
        self._closed = False

    def _serve_tiers(self, shared_writes: bool, on_writer_start: Callable[[], None]) -> TierStack:
        """The stack over the open tiers (see ``shared_writes`` in :meth:`__init__`)."""
        return TierStack(
            self.tiers,
            self.tier_codecs,
            [shared_writes or SHARED not in t.capabilities for t in self.tiers],
            pool=self.pool,
            quarantine=self.quarantine,
            counters=self.counters,
            write_queue_size=self.config.write_queue_size,
            on_writer_start=on_writer_start,
        )

    def _sealed_codecs(self, loaded: LoadedConfig) -> tuple[Codec, Mapping[str, Codec]]:
        """The top-level codec (``serde``) and every codec by name, sealed with
        :attr:`seal` when there is one."""
        codecs: Mapping[str, Codec] = self.plugins.codec_map()
        codec: Codec = self.plugins.get_codec(loaded.config.serde, source=loaded.source_of("serde"))
        if self.seal is not None:
            codec, codecs = SealedCodec(codec, self.seal), SealedCodecs(codecs, self.seal)
        return codec, codecs

    def _open_tiers(self, loaded: LoadedConfig) -> None:
        """Create every configured tier with its codec (``tiers``, ``tier_codecs``);
        if one fails, those already open are closed and the error raised."""
        cfg = loaded.config
        try:
            for i, section in enumerate(cfg.backends):
                tier_codec = self._tier_codec(section.serde, f"backends[{i}].serde", loaded.source_of("backends"))
                ctx = BackendContext(
                    key_path=f"backends[{i}]",
                    source=loaded.source_of("backends"),
                    config=cfg,
                    pool=self.pool,
                    codec=tier_codec,
                    codecs=tier_codecs(self.codecs, tier_codec),
                    plugins=self.plugins,
                )
                tier = self.plugins.create_backend(section, ctx)
                self.tiers.append(tier)
                self.tier_codecs.append(tier_codec)
                prepare = getattr(tier_codec, "prepare", None)
                if callable(prepare):
                    prepare()  # e.g. fp8's kernel, built here rather than by the first request
                if is_lossy(tier_codec):
                    log.warning(
                        "%s (%s) stores KV with the LOSSY codec %r: its frames are approximations, served "
                        "only by tiers configured with that codec",
                        ctx.key_path,
                        section.name,
                        tier_codec.name,
                    )
                if ZERO_COPY in tier.capabilities and self.plugins.pool_bytes(section) == 0:
                    log.warning(
                        "%s (%s) keeps chunks in the memory pool but declares no pool_bytes when it "
                        "registers: it shares the %d-byte staging headroom",
                        ctx.key_path,
                        section.name,
                        cfg.staging_size,
                    )
        except BaseException:
            for t in self.tiers:
                t.close()
            raise

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
        ns = self._ns_id
        return [ChunkKey(ns, h) for h in hashes]

    # -- lookup -----------------------------------------------------------------------
    def lookup_hashes(
        self, hashes: Sequence[bytes], *, pin_id: str | None = None, record: bool = True, add_pins: bool = False
    ) -> int:
        """Number of leading chunks present; with ``pin_id`` the hits in pinning tiers
        are pinned until :meth:`unpin` (so they are not evicted before the load). A
        repeated lookup under the same ``pin_id`` replaces the earlier pins, unless
        ``add_pins`` (an object probed next to a hit, e.g. its boundary: pinned with
        it, released with it). With ``record=False`` the lookup is not counted (a
        caller that probes several times for one request counts once with
        :meth:`record_lookup`)."""
        return sum(n for _, n in self.lookup_runs(hashes, pin_id=pin_id, record=record, add_pins=add_pins))

    def lookup_runs(
        self, hashes: Sequence[bytes], *, pin_id: str | None = None, record: bool = True, add_pins: bool = False
    ) -> list[tuple[int, int]]:
        """:meth:`lookup_hashes` that also says where the hits are: ``(tier index,
        chunks)`` runs in prefix order, so a caller can predict the load time.

        Linear in the number of keys whatever the tiers' interleaving: a tier is
        handed a copy-free window of the keys (:class:`KeyWindow`) rather than a
        slice of the rest, so a tier with an in-memory index touches only the keys
        it holds plus one. A tier's first call gets all the remaining keys (one
        round trip when a prompt lies in one tier); after a partial answer its
        window restarts at :data:`LOOKUP_WINDOW` keys and grows fourfold while it
        comes back full, so a tier that checks every key it is given (a batched
        remote lookup) does work in proportion to its hits plus a constant per call.
        """
        runs: list[tuple[int, int]] = []
        if pin_id is not None and not add_pins:
            self.unpin(pin_id)
        keys = self.keys(hashes)
        total = len(keys)
        windows: list[int | None] = [None] * len(self.tiers)  # None: all the remaining keys
        pos = 0
        while pos < total:
            advanced = False
            for tier in self.stack:
                w = windows[tier.level]
                stop = total if w is None else min(total, pos + w)
                if not tier.in_service:
                    continue
                n = tier.contains(KeyWindow(keys, pos, stop))
                if n is None:
                    continue
                windows[tier.level] = LOOKUP_WINDOW if n < stop - pos else (None if w is None else w * 4)
                if n > 0:
                    if pin_id is not None and tier.pinning:
                        self._pin(tier, pin_id, keys[pos : pos + n], -1 if add_pins else pos)
                    pos += n
                    runs.append((tier.level, n))
                    advanced = True
                    break
            if not advanced:
                break
        if not add_pins:
            self.stack.hint(lambda tier: tier.hint_chain(keys))
        if record:
            self.record_lookup(total, pos)
        return runs

    def predict_read_seconds(self, level: int, nbytes: int) -> float | None:
        """Predicted seconds to read one chunk of ``nbytes`` from tier ``level`` (from
        its measured reads), or ``None`` before it has served one."""
        return self.read_models[level].predict(nbytes)

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

    def _pin(self, tier: Tier, pin_id: str, keys: list[ChunkKey], pos: int) -> None:
        if not tier.pin(keys):
            return
        with self._pin_lock:
            self._pins.setdefault(pin_id, []).append((tier, keys, pos))

    def _unpin_all(self, pinned: Sequence[tuple[Tier, list[ChunkKey], int]]) -> None:
        for tier, keys, _ in pinned:
            tier.unpin(keys)

    def unpin(self, pin_id: str) -> None:
        """Release the pins taken by a lookup under ``pin_id`` (only in the tiers that
        took them). Unknown ids are ignored."""
        with self._pin_lock:
            pinned = self._pins.pop(pin_id, None)
        self.prefetcher.cancel(pin_id)
        self._unpin_all(pinned or ())

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

    def pinned_ids(self) -> set[str]:
        """The pin ids holding pins now (requests between lookup and release)."""
        with self._pin_lock:
            return set(self._pins)

    def keep_pinned(self, pin_id: str, n_chunks: int) -> None:
        """Keep only the first ``n_chunks`` chunks of ``pin_id``'s last lookup pinned
        (the prefix a caller decided to load, without a second lookup); the rest are
        released. Objects pinned next to the hit with ``add_pins`` stay pinned."""
        drop: list[tuple[Tier, list[ChunkKey], int]] = []
        with self._pin_lock:
            pinned = self._pins.pop(pin_id, [])
            keep = []
            for tier, keys, pos in pinned:
                cut = len(keys) if pos < 0 else max(0, min(len(keys), n_chunks - pos))
                if cut:
                    keep.append((tier, keys[:cut], pos))
                if cut < len(keys):
                    drop.append((tier, keys[cut:], pos + cut))
            if keep:
                self._pins[pin_id] = keep
        self._unpin_all(drop)

    # -- memory -----------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None:
        """A pool buffer for a chunk (evicting from the CPU tier if needed)."""
        return self.stack.allocate(shape, dtype)

    # -- store ------------------------------------------------------------------------
    def store_hashes(self, hashes: Sequence[bytes], chunks: Sequence[ChunkData], *, n_tokens: int | None = None) -> int:
        """Store chunks by prefix hash; returns how many new chunks reached the first
        tier. A chunk tier 0 already holds is skipped entirely, slower tiers included
        (a write a slow tier dropped earlier is not retried: it is a cache)."""
        tier0 = self.stack.top
        if tier0 is None:
            return 0
        stored = 0
        if not tier0.in_service:
            for key, data in zip(self.keys(hashes), chunks):
                if self.stack.writers:
                    self.stack.write_behind(key, data)
            return 0
        # the call's last chunk is partial (a prompt's last, fewer tokens than chunk_size)
        cs = self.chunk_size
        partial = n_tokens is not None and (len(hashes) - 1) * cs < n_tokens < len(hashes) * cs
        for i, (key, data) in enumerate(zip(self.keys(hashes), chunks)):
            if tier0.contains([key]):
                continue  # already cached (another request stored it): no rewrite
            buf: MemoryBuffer | None
            if isinstance(data, MemoryBuffer):
                buf, owned = data, False
            elif tier0.zero_copy:
                # Copy once into the pool: tier 0 adopts the buffer, write-behind shares it.
                buf, owned = self.allocate(tuple(data.shape), data.dtype), True
                if buf is not None:
                    buf.tensor.copy_(data)
            else:
                buf, owned = None, False
            try:
                ok = tier0.put(key, data if buf is None else buf)
                stored += ok
                if ok and partial and i == len(hashes) - 1:
                    self.stack.hint(lambda tier: tier.hint_partial(key), (tier0,))
                if self.stack.writers:
                    self.stack.write_behind(key, data if buf is None else buf)
            finally:
                if owned and buf is not None:
                    buf.release()
        toks = n_tokens if n_tokens is not None and stored == len(hashes) else stored * self.chunk_size
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
        self._await_prefetch(hashes)
        return fetch_run(self.stack, self.keys(hashes), shapes, dtype, pool=self._fetch_pool)

    def prefetch(
        self, hashes: Sequence[bytes], shapes: Sequence[Sequence[int]], dtype: torch.dtype, owner: str | None = None
    ) -> bool:
        """Start reading ``hashes`` from the slower tiers into the memory tier in the
        background (a hit found at lookup, before vLLM schedules its load) for request
        ``owner`` (its pin id: :meth:`unpin` cancels it), at most ``PREFETCH_BYTES``
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

    def _await_prefetch(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.prefetcher.await_run(bytes(hashes[0]))

    def _say_how_frames_are_sealed(self, loaded: LoadedConfig) -> None:
        """At start: a warning when a ``SHARED`` tier's frames are not sealed and the
        config does not say so on purpose (``frame_secret: none``), since anyone who
        can write to such a tier can plant KV this engine serves as a hit."""
        shared = [t.name for t in self.tiers if SHARED in t.capabilities]
        if self.seal is not None:
            log.info("frames are sealed (frame key id %s)", self.seal.key_id)
        elif shared and loaded.config.frame_secret_declined:
            log.info(
                "tiers %s are shared and their frames are not sealed: frame_secret: none (from %s)",
                ", ".join(shared),
                loaded.source_of("frame_secret"),
            )
        elif shared:
            log.warning(
                "tiers %s are shared and frame_secret is not set: anyone who can write to them can plant KV "
                "that this engine serves as a hit. Set frame_secret_file (see docs/security.md), or write "
                "frame_secret: none in the config to run them unsealed on purpose",
                ", ".join(shared),
            )

    def _tier_codec(self, name: str | None, key_path: str, source: str) -> Codec:
        """The codec of a tier whose section says ``serde: name`` (the top-level
        codec when it says nothing), sealed like it."""
        if name is None:
            return self.codec
        codec = self.plugins.get_codec(name, key_path=key_path, source=source)
        return SealedCodec(codec, self.seal) if self.seal is not None else codec

    # -- housekeeping -----------------------------------------------------------------
    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until background writes are done; False on timeout."""
        return self.stack.flush(timeout)

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
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self.pool.stop_populate()
        self.quarantine.close()
        self.stack.close(deadline)

    def __enter__(self) -> "CacheEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
