"""Worker side of the connector: owns the CacheEngine and moves KV between vLLM's
paged tensors and the cache, as the scheduler side planned.

Loads are synchronous in ``start_load_kv`` (vLLM calls it before the forward pass
when a step has synchronous loads), or, with ``async_loads`` (dense models), run on a
background thread from the moment the step's metadata is bound (see async_loads.py). Saves gather in ``wait_for_save``, after every
layer of the step has written its KV, into pool buffers the CPU tier adopts without a
copy; slower tiers are written in the background by the engine. Nothing here may
crash vLLM: a failed load marks its blocks for recompute, a failed save is skipped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Sequence

import torch

from lmcache_core import metrics
from lmcache_core.backend import ZERO_COPY
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import KeyNamespace

from .async_loads import IDLE_WAIT_S, LoadQueue
from .async_saves import SaveQueue
from .grouped_layout import GroupedLayout
from .kv_events import RawEvent, TierEventBuffer
from .groups import FULL, GroupPlan, boundary_hash
from .kv_adapters import BlockLayout, TokenLayout, make_layout, transfer_path
from .layerwise import LayerPipeline, LoadItem, SaveItem
from .load_policy import ALWAYS, REPROBE_S, PrefillModel, best_prefix
from .lookup_ipc import Hit, LookupServer
from .metadata import ChunkTransfer, LMCacheConnectorMetadata
from .options import AUTO, ConnectorSettings
from .verify import compare

from .log import get_logger

log = get_logger(__name__)

# The per-layer KV layout contract the fingerprint is relative to: vLLM 0.32's [B, H, N, C]
# views in a KVCacheLayout order (0.33 keeps it). Change it when vLLM changes what they hold.
VLLM_TAG = "vllm-0.32"


MAX_BOUNDARY_PROBES = 64
#: async_loads: auto loads a hit in the background when reading it from a tier slower
#: than memory is predicted to take longer than this (or has not been measured yet)
ASYNC_LOAD_S = 0.005


def _boundary_pin(pin_id: str | None) -> str | None:
    return None if pin_id is None else f"{pin_id}/boundary"


def _dtype_of(kv: Any) -> str:
    ts = [kv] if isinstance(kv, torch.Tensor) else list(kv)
    return "+".join(str(t.dtype).removeprefix("torch.") for t in ts)


class WorkerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        model_id: str,
        block_size: int,
        rank: int,
        world_size: int,
        lookup_address: str | None,
        plan: GroupPlan | None = None,
        pages: tuple[dict[int, int], dict[int, int]] = ({}, {}),
        kv_events: bool = False,
        replicated: bool = False,
    ) -> None:
        """``pages``: each KV-cache group's page size in vLLM's pool and its data bytes;
        ``kv_events``: report tier stores and evictions for vLLM's KV events;
        ``replicated``: every rank holds the same KV (MLA under tensor parallelism):
        keys carry no rank, and only rank 0 writes the shared tiers."""
        self.settings = settings
        self.cfg = settings.core
        self.model_id = model_id
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.lookup_address = lookup_address
        self.plan = plan
        self._page_bytes, self._real_bytes = pages
        self.layout: BlockLayout | TokenLayout | GroupedLayout | None = None
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self.engine: CacheEngine | None = None
        self.server: LookupServer | None = None
        self._errors: set[int] = set()
        self._lock = threading.Lock()
        self.loaded_tokens = 0
        self.saved_tokens = 0
        self.failed_loads = 0
        self.skipped_saves = 0
        self.load_seconds = 0.0
        self.save_seconds = 0.0
        # load_policy: the engine's compute time per step, timed here (see load_policy.py)
        self.load_policy = self.cfg.load_policy
        self.prefill = PrefillModel()
        self.bypassed_tokens = 0
        self.bypassed_lookups = 0
        self._chunk_bytes = 0
        self._fwd_start: float | None = None
        self._step_load_s = 0.0
        self._reported: dict[str, float] = {}
        self.kv_events = kv_events
        self.replicated = replicated
        self.tier_events: TierEventBuffer | None = None
        # canary: chunks compared with the cache, and those equal only within tolerance
        self.verified_chunks = 0
        self.verify_inexact = 0
        self._value_dtype: torch.dtype | None = None  # element type behind grouped (byte) chunks
        self.saves: SaveQueue | None = None  # async_saves (dense models)
        self.loads: LoadQueue | None = None  # async_loads (dense models)
        self.pipeline: LayerPipeline | None = None  # layerwise (dense models)
        self._step_idle = False  # this step computes nothing (async_loads: wait for loads instead of spinning)
        self.suspended = False  # vLLM's sleep mode: the KV tensors are released; no copy touches them

    # -- set-up -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.plan is not None and self.plan.hybrid:
            self.layout = GroupedLayout(kv_caches, self.plan, self._page_bytes, self._real_bytes)
            dtype = "+".join(sorted({_dtype_of(t) for t in kv_caches.values()}))
            full = {
                t.dtype
                for g in self.plan.of_kind(FULL)
                for n in g.layer_names
                for t in [kv_caches[n]]
                if isinstance(t, torch.Tensor)
            }
            self._value_dtype = full.pop() if len(full) == 1 else None
        else:
            self.layout = make_layout(self.cfg.layout, kv_caches, self.block_size)
            dtype = str(self.layout.dtype).removeprefix("torch.")
        ns = KeyNamespace(
            model=self.model_id,
            layout=f"{VLLM_TAG}/{self.layout.fingerprint()}",
            dtype=dtype,
            world_size=1 if self.replicated else self.world_size,
            rank=0 if self.replicated else self.rank,
        )
        self.engine = CacheEngine(self.settings.loaded, namespace=ns, shared_writes=not self.replicated or self.rank == 0)
        if self.kv_events:
            ranks = [dataclasses.replace(self.engine.namespace, rank=r).id for r in range(ns.world_size)]
            self.tier_events = TierEventBuffer(self.rank, ranks)
            self.engine.add_listener(self.tier_events)
        shape = self.layout.chunk_shape(self.cfg.chunk_size)
        elem = torch.empty((), dtype=torch.uint8 if isinstance(self.layout, GroupedLayout) else self.layout.dtype).element_size()
        self._chunk_bytes = int(torch.Size(shape).numel()) * elem
        log.info(
            "lmcache-core: %s layout, chunk %d tokens, tiers %s, transfer path %s%s",
            self.layout.kind,
            self.cfg.chunk_size,
            [t.name for t in self.engine.tiers],
            transfer_path(self.layout.device),
            f", KV-cache groups: {self.plan.describe()}" if self.plan is not None and self.plan.hybrid else "",
        )
        if self.lookup_address:
            # Memory-only tiers: a scheduler in this process may call the lookup directly.
            inline = all(ZERO_COPY in t.capabilities for t in self.engine.tiers)
            self.server = LookupServer(self.lookup_address, self._lookup, inline=inline)
        if self.settings.async_saves and not isinstance(self.layout, GroupedLayout):
            self.saves = SaveQueue(self._save_logged)
        if self.settings.async_loads and not isinstance(self.layout, GroupedLayout):
            self.loads = LoadQueue(self._load_background, self.block_size)
        if self.settings.layerwise:
            if isinstance(self.layout, GroupedLayout):
                log.info("lmcache-core: layerwise has no effect with several KV-cache groups (whole-step copies)")
            else:
                self.pipeline = LayerPipeline(self.layout, list(kv_caches))

    def _pipelined(self) -> LayerPipeline | None:
        return self.pipeline if self.pipeline is not None and self.pipeline.active else None

    def _lookup(self, hashes: Sequence[bytes], pin_id: str | None) -> int:
        assert self.engine is not None
        boundary = self.plan is not None and self.plan.has_boundary
        auto = self.settings.async_loads == AUTO and self.loads is not None
        if not boundary and not auto and (self.load_policy == ALWAYS or pin_id is None):
            return self.engine.lookup_hashes(hashes, pin_id=pin_id)
        runs = self.engine.lookup_runs(hashes, pin_id=pin_id, record=False)
        n = sum(c for _, c in runs)
        k = self._worth_loading(hashes, runs, pin_id) if pin_id is not None and self.load_policy != ALWAYS else n
        if boundary and k:
            k = n = self._restorable(hashes, k, pin_id)
        self.engine.record_lookup(len(hashes), n)
        slow = auto and self._slow(runs, k)
        if slow and pin_id is not None and self.layout is not None:
            # Start reading the hit into the CPU tier now: vLLM schedules its load a
            # step or more later (after allocating blocks), and the load then waits for
            # this read instead of making its own.
            dtype = torch.uint8 if isinstance(self.layout, GroupedLayout) else self.layout.dtype
            self.engine.prefetch(hashes[:k], [self.layout.chunk_shape(self.cfg.chunk_size)] * k, dtype)
        return Hit(k, slow)

    def _slow(self, runs: Sequence[tuple[int, int]], k: int) -> bool:
        """Whether loading the first ``k`` chunks needs a tier slower than memory: one
        that is not the zero-copy CPU tier and whose measured reads of that many bytes
        take longer than ``ASYNC_LOAD_S`` (or have not been measured yet). Such a load
        goes to the load thread (``async_loads: auto``), off vLLM's forward path."""
        assert self.engine is not None
        left = k
        for level, count in runs:
            if left <= 0:
                break
            take = min(count, left)
            left -= take
            tier = self.engine.tiers[level]
            if ZERO_COPY in tier.capabilities:
                continue
            predicted = self.engine.predict_read_seconds(level, take * self._chunk_bytes)
            if predicted is None or predicted > ASYNC_LOAD_S:
                return True
        return False

    def _worth_loading(self, hashes: Sequence[bytes], runs: list[tuple[int, int]], pin_id: str) -> int:
        """``faster_than_recompute``: the hit prefix worth loading; the chunks past it
        are unpinned and counted as bypassed."""
        assert self.engine is not None
        per_chunk: list[float] = []
        for level, count in runs:
            age = self.engine.read_models[level].fit.age()
            fresh = age is not None and age <= REPROBE_S
            s = self.engine.predict_read_seconds(level, self._chunk_bytes) if fresh else None
            per_chunk += [s or 0.0] * count  # never read (or not lately): load once to measure
        n = len(per_chunk)
        k = best_prefix(per_chunk, self.cfg.chunk_size, self.prefill, self.cfg.load_margin)
        if k < n:
            if k:
                self.engine.lookup_hashes(hashes[:k], pin_id=pin_id, record=False)  # re-pin only what loads
            else:
                self.engine.unpin(pin_id)
            tokens = (n - k) * self.cfg.chunk_size
            with self._lock:
                self.bypassed_tokens += tokens
                self.bypassed_lookups += 1
            metrics.BYPASSED_TOKENS.inc(tokens)
            log.debug(
                "lookup %s: loading %d of %d hit chunks (predicted load %.1f ms, recompute %.1f ms)",
                pin_id,
                k,
                n,
                1000 * sum(per_chunk),
                1000 * (self.prefill.recompute_seconds(n * self.cfg.chunk_size) or 0.0),
            )
        return k

    def _restorable(self, hashes: Sequence[bytes], n: int, pin_id: str | None) -> int:
        """The longest prefix of ``n`` present chunks that also has its boundary object
        (window pages / states), probing at most ``MAX_BOUNDARY_PROBES`` boundaries
        from the longest down; that boundary is pinned with the chunks."""
        assert self.engine is not None
        bpin = _boundary_pin(pin_id)
        for k in range(n, max(0, n - MAX_BOUNDARY_PROBES), -1):
            if self.engine.lookup_hashes([boundary_hash(hashes[k - 1])], pin_id=bpin, record=False):
                return k
        if bpin is not None:
            self.engine.unpin(bpin)
        return 0

    # -- loads --------------------------------------------------------------------------
    def step_started(self, meta: LMCacheConnectorMetadata | None = None) -> None:
        """vLLM bound this step's metadata: its forward pass runs from now until
        ``wait_for_save`` (minus synchronous loads), timed for load_policy. vLLM calls
        ``start_load_kv`` before the forward only when a step has synchronous loads,
        otherwise after it, so the binding is the only reliable start. Background
        saves that may read blocks freed by a preemption finish here, before any
        write of the step."""
        if self.saves is not None and meta is not None and meta.drain_saves:
            self.saves.drain()
        self._step_idle = meta is not None and meta.step_tokens == 0
        if self.loads is not None and meta is not None and not self.suspended:
            # Asynchronous loads start now, before the forward pass they may overlap.
            background = [t for t in meta.loads if self._in_background(t)]
            if background:
                self.loads.submit(meta, background)
        self._fwd_start = time.perf_counter()
        self._step_load_s = 0.0

    def _in_background(self, t: ChunkTransfer) -> bool:
        return self.loads is not None and t.async_load and t.group_block_ids is None

    def start_load_kv(self, meta: LMCacheConnectorMetadata) -> None:
        if self.engine is None:
            return
        if self.suspended:  # vLLM's KV memory is released: report every load failed (recompute)
            for t in meta.loads:
                blocks = self._fail(t, meta, 0)
                if self._in_background(t):  # reported as a finished, failed load
                    with self._lock:
                        self._errors |= blocks
                        self._recv_done.add(t.req_id)
                self.engine.unpin(t.req_id)
                self.engine.unpin(_boundary_pin(t.req_id) or "")
            return
        t_start = time.perf_counter()
        pipe = self._pipelined()
        items: list[LoadItem] = []
        for t in meta.loads:
            if self._in_background(t):
                continue  # handed to the load thread in step_started
            try:
                if t.group_block_ids is not None:
                    self._load_grouped(t, meta)
                elif pipe is not None:
                    items += self._read_for_pipeline(t, meta)
                else:
                    self._load(t, meta)
            except Exception as err:  # never crash vLLM: recompute instead
                log.warning("request %s: load failed, recomputing: %s: %s", t.req_id, type(err).__name__, err)
                self._fail(t, meta, 0)
            finally:
                self.engine.unpin(t.req_id)
                self.engine.unpin(_boundary_pin(t.req_id) or "")
        if pipe is not None and items:
            try:
                pipe.load(items)
            except Exception as err:  # never crash vLLM: recompute every chunk of the step
                log.warning("layerwise load failed, recomputing: %s: %s", type(err).__name__, err)
                for t in meta.loads:
                    if not self._in_background(t) and t.group_block_ids is None:
                        self._fail(t, meta, 0)
        for rid in meta.unpins:
            self.engine.unpin(rid)
            self.engine.unpin(_boundary_pin(rid) or "")
        if self._fwd_start is not None:  # loads are not compute: keep them out of the step's time
            self._step_load_s += time.perf_counter() - t_start

    def _load_background(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> set[int]:
        """One asynchronous load, on the load thread: the blocks that failed (the
        thread reports them with the request's completion)."""
        try:
            return self._load(t, meta)
        except Exception as err:  # never crash vLLM: recompute instead
            log.warning("request %s: load failed, recomputing: %s: %s", t.req_id, type(err).__name__, err)
            return self._fail(t, meta, 0)
        finally:
            if self.engine is not None:
                self.engine.unpin(t.req_id)

    def _load(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> set[int]:
        """Copy the chunks into vLLM's blocks: the blocks that failed to load."""
        assert self.engine is not None and self.layout is not None and not isinstance(self.layout, GroupedLayout)
        t0 = time.perf_counter()
        loaded = got = 0
        failed: set[int] = set()
        # Chunks come in order from every tier in batches (lmcache_core.fetch); on a
        # GPU their copies are enqueued one after another and waited for once, their
        # buffers held until then.
        batch = self.layout.device.type == "cuda"
        held: list[Any] = []
        chunks = self.engine.iter_chunks(t.hashes, self._chunk_shapes(t, meta), self.layout.dtype)
        try:
            for i, buf in enumerate(chunks):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                try:
                    self.layout.load_chunk(buf.tensor, t.block_ids, lo, hi, t.write_from, wait=not batch)
                finally:
                    if batch:
                        held.append(buf)
                    else:
                        buf.release()
                loaded += hi - max(lo, t.write_from)
                got += 1
        finally:
            chunks.close()
            if held:
                self.layout.finish()
                for buf in held:
                    buf.release()
        if got < len(t.hashes):
            failed = self._fail(t, meta, got)
        dt = time.perf_counter() - t0
        with self._lock:
            self.loaded_tokens += loaded
            self.load_seconds += dt
        metrics.LOADED_TOKENS.inc(loaded)
        metrics.TIER_LATENCY.labels("connector", "load_request").observe(dt)
        return failed

    def _chunk_shapes(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> list[tuple[int, ...]]:
        assert self.layout is not None
        return [self.layout.chunk_shape(t.chunk_ends[i] - meta.chunk_start(t, i)) for i in range(len(t.hashes))]

    def _read_for_pipeline(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> list[LoadItem]:
        """layerwise: read a transfer's chunks from the cache (a miss fails the chunks
        from it on, as in ``_load``); the copies are enqueued by the pipeline."""
        assert self.engine is not None and self.layout is not None and not isinstance(self.layout, GroupedLayout)
        t0 = time.perf_counter()
        items: list[LoadItem] = []
        loaded = 0
        for i, buf in enumerate(self.engine.iter_chunks(t.hashes, self._chunk_shapes(t, meta), self.layout.dtype)):
            lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
            items.append(LoadItem(buf, t.block_ids, lo, hi, t.write_from))
            loaded += hi - max(lo, t.write_from)
        if len(items) < len(t.hashes):
            self._fail(t, meta, len(items))
        dt = time.perf_counter() - t0
        with self._lock:
            self.loaded_tokens += loaded
            self.load_seconds += dt
        metrics.LOADED_TOKENS.inc(loaded)
        return items

    # -- layer by layer (layerwise) ------------------------------------------------------
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.pipeline is not None:
            self.pipeline.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, meta: LMCacheConnectorMetadata | None) -> None:
        pipe = self._pipelined()
        if pipe is None or meta is None or self.engine is None or self.suspended:
            return
        if not pipe.pending_saves() and not any(t.group_block_ids is None for t in meta.saves):
            return
        try:
            pipe.save_layer(layer_name, lambda: self._plan_saves(meta))
        except Exception as err:  # the step's dense saves are gathered in wait_for_save instead
            log.warning("layerwise save failed, gathering at the end of the step: %s: %s", type(err).__name__, err)
            for s in pipe.end_saves():
                s.buf.release()
            pipe._disable(f"save_kv_layer raised {type(err).__name__}")

    def _plan_saves(self, meta: LMCacheConnectorMetadata) -> list[SaveItem]:
        """layerwise: one pool buffer per chunk this step saves (dense transfers); a
        transfer whose buffers run out keeps the chunks before (a future miss after)."""
        assert self.engine is not None and self.layout is not None and not isinstance(self.layout, GroupedLayout)
        items: list[SaveItem] = []
        for t in meta.saves:
            if t.group_block_ids is not None:
                continue
            for i, h in enumerate(t.hashes):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                buf = self.engine.allocate(self.layout.chunk_shape(hi - lo), self.layout.dtype)
                if buf is None:
                    with self._lock:
                        self.skipped_saves += 1
                    break
                items.append(SaveItem(buf, t.block_ids, lo, hi, payload=(h, t.first_chunk + i < t.verify_below)))
        return items

    def _store_pipelined(self, pipe: LayerPipeline) -> None:
        """wait_for_save (layerwise): the chunks gathered layer by layer, stored."""
        t0 = time.perf_counter()
        saved = 0
        items = pipe.end_saves()
        try:
            for s in items:
                h, verify = s.payload
                if self._verify_or_store(h, s.buf, s.hi - s.lo, verify):
                    saved += s.hi - s.lo
        finally:
            for s in items:
                s.buf.release()
            with self._lock:
                self.saved_tokens += saved
                self.save_seconds += time.perf_counter() - t0

    def _load_grouped(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        """All chunks and the boundary, or nothing: a recurrent state resumes exactly at
        its boundary, so a partial load is reported as a failed request (vLLM then
        recomputes it from its own prefix cache or from scratch)."""
        assert self.engine is not None and isinstance(self.layout, GroupedLayout)
        assert t.group_block_ids is not None
        t0 = time.perf_counter()
        loaded = got = 0
        shapes = [self.layout.chunk_shape(t.chunk_ends[i] - meta.chunk_start(t, i)) for i in range(len(t.hashes))]
        chunks = self.engine.iter_chunks(t.hashes, shapes, torch.uint8)
        try:
            for i, buf in enumerate(chunks):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                try:
                    self.layout.load_chunk(buf.tensor, t.group_block_ids, lo, hi, t.write_from)
                finally:
                    buf.release()
                loaded += hi - max(lo, t.write_from)
                got += 1
        finally:
            chunks.close()
        if got < len(t.hashes):
            raise LookupError(f"chunk {t.first_chunk + got} is no longer in the cache")
        for bh, end in t.boundaries:
            bbuf = self.engine.retrieve_buffer(bh, self.layout.boundary_shape(end), torch.uint8)
            if bbuf is None:
                raise LookupError(f"the boundary object at token {end} is no longer in the cache")
            try:
                self.layout.load_boundary(bbuf.tensor, t.group_block_ids, end, t.write_from)
            finally:
                bbuf.release()
        dt = time.perf_counter() - t0
        with self._lock:
            self.loaded_tokens += loaded
            self.load_seconds += dt
            if t.async_load:
                self._recv_done.add(t.req_id)
        metrics.LOADED_TOKENS.inc(loaded)
        metrics.TIER_LATENCY.labels("connector", "load_request").observe(dt)

    def _fail(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata, from_chunk: int) -> set[int]:
        """Report the blocks of chunks ``from_chunk..`` so vLLM recomputes them (the
        whole request, for asynchronous loads of multi-group models). Returns the
        blocks of a background load instead: the load thread reports them with the
        request's completion."""
        if t.async_load and t.group_block_ids is not None:
            with self._lock:
                self._recv_failed.add(t.req_id)
                self._recv_done.add(t.req_id)
                self.failed_loads += 1
            self._count_load_errors(len(t.hashes) - from_chunk)
            return set()
        lo = max(meta.chunk_start(t, from_chunk), t.write_from)
        hi = t.chunk_ends[-1]
        blocks = set(t.block_ids[lo // self.block_size : -(-hi // self.block_size)])
        with self._lock:
            if not self._in_background(t):
                self._errors.update(blocks)
            self.failed_loads += 1
        self._count_load_errors(len(t.hashes) - from_chunk)
        return blocks

    def _count_load_errors(self, n_chunks: int) -> None:
        if self.engine is not None:
            self.engine.record_load_errors(n_chunks)

    def take_tier_events(self) -> list[RawEvent]:
        """Tier stores and evictions since the last call (KV events)."""
        return self.tier_events.take() if self.tier_events is not None else []

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errs, self._errors = self._errors, set()
        return errs

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads completed since the last call: (finished, failed); failed
        ones are in both sets, as vLLM expects."""
        with self._lock:
            done, failed = self._recv_done, self._recv_failed
            self._recv_done, self._recv_failed = set(), set()
        if self.loads is not None:
            if self._step_idle:
                self.loads.wait_idle(IDLE_WAIT_S)
            # A background load's failed blocks go out in this step's
            # get_block_ids_with_load_errors, with (never after) its completion.
            bg_done, bg_errors = self.loads.take()
            done |= bg_done
            with self._lock:
                self._errors |= bg_errors
        return done, failed

    # -- saves --------------------------------------------------------------------------
    def wait_for_save(self, meta: LMCacheConnectorMetadata) -> None:
        if self.engine is None or self.suspended:
            return
        if self._fwd_start is not None and meta.step_tokens > 0:
            self.prefill.record(meta.step_tokens, meta.step_pairs, time.perf_counter() - self._fwd_start - self._step_load_s)
        self._fwd_start = None
        transfers = meta.saves
        if self.pipeline is not None:
            self.pipeline.end_loads()
            if self.pipeline.pending_saves():
                try:
                    self._store_pipelined(self.pipeline)
                except Exception as err:  # a failed save is a future miss
                    log.warning("layerwise saves failed, skipped: %s: %s", type(err).__name__, err)
                transfers = [t for t in transfers if t.group_block_ids is not None]
        if self.saves is not None:
            self.saves.submit(meta, [t for t in transfers if t.group_block_ids is None])
            transfers = [t for t in transfers if t.group_block_ids is not None]
        for t in transfers:
            self._save_logged(t, meta)

    def _save_logged(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        """Save one transfer (here or on the background queue): a failure is a
        skipped save, a future miss, never a crash."""
        try:
            if t.group_block_ids is not None:
                self._save_grouped(t, meta)
            else:
                self._save(t, meta)
        except Exception as err:
            log.warning("request %s: save failed, skipped: %s: %s", t.req_id, type(err).__name__, err)
            with self._lock:
                self.skipped_saves += 1

    def take_finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose background saves are all done (``finished_sending``)."""
        return self.saves.finished(finished_req_ids) if self.saves is not None else set()

    def _save(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        """Gather and store chunk by chunk: one pool buffer in flight at a time (on a
        GPU: the transfer's gathers enqueued together, waited for once, then stored)."""
        assert self.engine is not None and self.layout is not None and not isinstance(self.layout, GroupedLayout)
        t0 = time.perf_counter()
        saved = 0
        batch = self.layout.device.type == "cuda"
        gathered: list[tuple[bytes, Any, int, bool]] = []
        try:
            try:
                for i, h in enumerate(t.hashes):
                    lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                    buf = self.engine.allocate(self.layout.chunk_shape(hi - lo), self.layout.dtype)
                    if buf is None:  # pool exhausted by chunks in flight: a future miss
                        with self._lock:
                            self.skipped_saves += 1
                        break
                    verify = t.first_chunk + i < t.verify_below
                    if batch:
                        gathered.append((h, buf, hi - lo, verify))
                        self.layout.save_chunk(t.block_ids, lo, hi, buf.tensor, wait=False)
                        continue
                    try:
                        self.layout.save_chunk(t.block_ids, lo, hi, buf.tensor)
                        if self._verify_or_store(h, buf, hi - lo, verify):
                            saved += hi - lo
                    finally:
                        buf.release()
            finally:
                if gathered:
                    self.layout.finish()  # before any buffer is read, stored or reused
            for h, buf, n, verify in gathered:
                if self._verify_or_store(h, buf, n, verify):
                    saved += n
        finally:
            for _, buf, _, _ in gathered:
                buf.release()
            with self._lock:
                self.saved_tokens += saved
                self.save_seconds += time.perf_counter() - t0

    def _save_grouped(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        assert self.engine is not None and isinstance(self.layout, GroupedLayout)
        assert t.group_block_ids is not None
        t0 = time.perf_counter()
        saved = 0
        try:
            for i, h in enumerate(t.hashes):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                verify = t.first_chunk + i < t.verify_below
                if self._store_one(
                    h,
                    self.layout.chunk_shape(hi - lo),
                    hi - lo,
                    lambda out: self.layout.save_chunk(t.group_block_ids, lo, hi, out),
                    verify,
                ):
                    saved += hi - lo
            for bh, end in t.boundaries:
                self._store_one(
                    bh, self.layout.boundary_shape(end), 0, lambda out: self.layout.save_boundary(t.group_block_ids, end, out)
                )
        finally:
            with self._lock:
                self.saved_tokens += saved
                self.save_seconds += time.perf_counter() - t0

    def _store_one(self, h: bytes, shape: tuple[int, ...], n_tokens: int, fill: Any, verify: bool = False) -> bool:
        """Allocate a pool buffer, let ``fill`` gather into it (False: nothing to
        store), store it under ``h`` (or compare it with the cache: ``verify``)."""
        assert self.engine is not None
        buf = self.engine.allocate(shape, torch.uint8)
        if buf is None:  # pool exhausted by chunks in flight: a future miss
            with self._lock:
                self.skipped_saves += 1
            return False
        try:
            if fill(buf.tensor) is False:
                return False
            return self._verify_or_store(h, buf, n_tokens, verify)
        finally:
            buf.release()

    def _verify_or_store(self, h: bytes, buf: Any, n_tokens: int, verify: bool) -> bool:
        """Store a freshly gathered chunk; a chunk of a verified hit (canary) is
        compared with every tier's copy instead, and stored only if none holds it."""
        assert self.engine is not None
        if verify:
            vd = self._value_dtype
            verdicts = self.engine.verify(h, buf, lambda stored, fresh: compare(stored, fresh, vd))
            if verdicts:
                with self._lock:
                    self.verified_chunks += 1
                    self.verify_inexact += sum(1 for v in verdicts if v.equal and v.detail != "bit-identical")
                return False
        return bool(self.engine.store_hashes([h], [buf], n_tokens=n_tokens))

    # -- metrics ------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Cumulative counters, flat, as shipped to vLLM's metrics."""
        out: dict[str, float] = {
            "loaded_tokens": self.loaded_tokens,
            "saved_tokens": self.saved_tokens,
            "bypassed_tokens": self.bypassed_tokens,
            "verified_chunks": self.verified_chunks,
            "verify_inexact": self.verify_inexact,
            "load_seconds": self.load_seconds,
            "save_seconds": self.save_seconds,
        }
        if self.engine is not None:
            c = self.engine.counters.snapshot()
            out.update(
                lookups=c["lookups"], lookup_tokens=c["lookup_tokens"], hit_tokens=c["hit_tokens"], load_errors=c["load_errors"]
            )
            for tier in self.engine.tiers:
                try:
                    s = tier.stats()
                except Exception:  # a broken tier reports nothing this step
                    continue
                out[f"tier_put_bytes/{tier.name}"] = s.put_bytes
                out[f"tier_get_bytes/{tier.name}"] = s.get_bytes
                out[f"tier_evictions/{tier.name}"] = s.evictions
                out[f"tier_used_bytes/{tier.name}"] = s.bytes_used
                out[f"tier_capacity_bytes/{tier.name}"] = s.bytes_capacity or 0
                out[f"tier_errors/{tier.name}"] = c["backend_errors"].get(tier.name, 0)
                out[f"verify_mismatches/{tier.name}"] = c["verify_mismatches"].get(tier.name, 0)
                out[f"tier_quarantined/{tier.name}"] = int(self.engine.quarantine.is_quarantined(tier.name))
        return out

    def take_stats_delta(self) -> dict[str, float]:
        """Counter increments since the previous call (vLLM sums these)."""
        now = self.counters()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return {k: v for k, v in delta.items() if v}

    # -- sleep mode (vLLM >= 0.33: unregister_kv_caches / restore_kv_caches) ------------
    def suspend(self) -> None:
        """Before vLLM releases the KV cache memory: finish every copy that reads or
        writes vLLM's blocks (background loads and saves, the layer pipeline), then
        touch no block until :meth:`resume`. Steps in between load and save nothing
        (a hit is then recomputed). What the tiers hold stays valid. Idempotent."""
        if self.loads is not None:
            self.loads.drain()
        if self.saves is not None:
            self.saves.drain()
        if self.pipeline is not None:
            self.pipeline.end_loads()
            for s in self.pipeline.end_saves():
                s.buf.release()
        self.suspended = True

    def resume(self) -> None:
        """After wake-up: vLLM's KV tensors are the same objects at the same addresses
        (vLLM's sleep allocator keeps them), so the layouts stay valid. Idempotent."""
        self.suspended = False

    # -- housekeeping -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "loaded_tokens": self.loaded_tokens,
            "saved_tokens": self.saved_tokens,
            "failed_loads": self.failed_loads,
            "skipped_saves": self.skipped_saves,
            "bypassed_tokens": self.bypassed_tokens,
            "bypassed_lookups": self.bypassed_lookups,
            "load_policy": self.load_policy,
            "verified_chunks": self.verified_chunks,
            "verify_inexact": self.verify_inexact,
            "async_loads": self.loads.submitted if self.loads is not None else 0,
        }
        if self.pipeline is not None:
            out["layerwise"] = {
                "active": self.pipeline.active,
                "loaded_chunks": self.pipeline.pipelined_loads,
                "saved_chunks": self.pipeline.pipelined_saves,
                "late_save_layers": self.pipeline.late_save_layers,
            }
        if self.engine is not None:
            out["engine"] = self.engine.stats()
        return out

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.loads is not None:
            self.loads.close()
            self.loads = None
        if self.saves is not None:
            self.saves.close()
            self.saves = None
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.engine is not None:
            self.engine.flush(timeout=10)
            self.engine.close()
