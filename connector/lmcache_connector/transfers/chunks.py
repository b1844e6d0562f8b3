"""How a step's chunks move between vLLM's paged KV tensors and the cache: one object
per layout, chosen once when vLLM registers its KV caches.

* :class:`DenseTransfers`: one KV-cache group (dense and MLA models). Loads run in
  the step (``start_load_kv``), on the load thread (``async_loads``) or layer by
  layer (``layerwise``); saves in ``wait_for_save``, on the save thread
  (``async_saves``) or layer by layer. The strategies are parts of this object,
  present or not, never flags tested per transfer.
* :class:`GroupedTransfers`: several KV-cache groups (hybrid models: sliding window,
  state space). Chunks are byte views over every group, and a request's boundary
  object (window pages or recurrent states) travels with them: all or nothing.

Both report through the same :class:`LoadReports` and count into the same
:class:`TransferCounters`; both store through :class:`ChunkSaver`, where the canary
(``verify_fraction``) compares instead of storing. Nothing here may crash vLLM: a
failed load marks its blocks (or its request) for recompute, a failed save is
skipped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, TypeVar

import torch

from lmcache_core import metrics
from lmcache_core.canary import compare

from .async_loads import IDLE_WAIT_S, LoadQueue
from .async_saves import SaveQueue
from ..engine_api import ConnectorEngine
from ..layouts.grouped_layout import GroupedLayout
from ..layouts.kv_adapters import BlockLayout, TokenLayout
from .layerwise import Borrowed, LayerPipeline, LoadItem, SaveItem
from ..log import get_logger
from ..protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata
from ..options import ConnectorSettings

log = get_logger(__name__)

R = TypeVar("R")


@dataclasses.dataclass
class TransferCounters:
    """What the transfers did, cumulative (reported in ``stats`` and vLLM's metrics)."""

    loaded_tokens: int = 0
    saved_tokens: int = 0
    failed_loads: int = 0
    skipped_saves: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    verified_chunks: int = 0  # canary: chunks compared with the cache instead of stored
    verify_inexact: int = 0  # of those, equal only within tolerance
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def loaded(self, tokens: int, seconds: float) -> None:
        self.add(loaded_tokens=tokens, load_seconds=seconds)
        metrics.LOADED_TOKENS.inc(tokens)


class LoadReports:
    """What vLLM asks the worker for after a step: blocks that failed to load, and
    asynchronous loads that finished (and failed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: set[int] = set()
        self._done: set[str] = set()
        self._failed: set[str] = set()

    def blocks_failed(self, blocks: set[int]) -> None:
        with self._lock:
            self._errors |= blocks

    def finished(self, req_id: str, failed: bool = False) -> None:
        with self._lock:
            self._done.add(req_id)
            if failed:
                self._failed.add(req_id)

    def take_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def take_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed


class ChunkSaver:
    """Stores freshly gathered chunks; a chunk of a verified hit (the canary) is
    compared with every tier's copy instead, and stored only if none holds it."""

    def __init__(self, engine: ConnectorEngine, counters: TransferCounters, value_dtype: torch.dtype | None) -> None:
        self.engine = engine
        self.counters = counters
        self.value_dtype = value_dtype  # element type behind byte chunks (grouped), for the comparison

    def store(self, h: bytes, buf: Any, n_tokens: int, verify: bool) -> bool:
        if verify:
            vd = self.value_dtype
            verdicts = self.engine.canary.verify(h, buf, lambda stored, fresh: compare(stored, fresh, vd))
            if verdicts:
                # a chunk, however many tiers held it (so it never outruns verified_chunks)
                inexact = int(any(v.equal and v.detail != "bit-identical" for v in verdicts))
                self.counters.add(verified_chunks=1, verify_inexact=inexact)
                return False
        return bool(self.engine.store_hashes([h], [buf], n_tokens=n_tokens))

    def gather_and_store(
        self,
        h: bytes,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        n_tokens: int,
        fill: Callable[[Any], Any],
        verify: bool = False,
    ) -> bool:
        """Allocate a pool buffer, let ``fill`` gather into it (False: nothing to
        store), then :meth:`store` it. A pool exhausted by chunks in flight is a
        skipped save (a future miss)."""
        buf = self.engine.allocate(shape, dtype)
        if buf is None:
            self.counters.add(skipped_saves=1)
            return False
        try:
            if fill(buf.tensor) is False:
                return False
            return self.store(h, buf, n_tokens, verify)
        finally:
            buf.release()


class Transfers:
    """The part of the worker that touches vLLM's blocks, for one layout. The base
    class itself, with no engine (:meth:`idle`), stands in until vLLM registers its
    KV caches: it has no loads or saves to run, and every call does nothing."""

    kind = ""
    layout: BlockLayout | TokenLayout | GroupedLayout
    #: the strategies a layout may run (the dense one's; None where it has none)
    loads: LoadQueue | None = None
    saves: SaveQueue | None = None
    pipeline: LayerPipeline | None = None

    def __init__(
        self,
        engine: ConnectorEngine,
        counters: TransferCounters,
        reports: LoadReports,
        saver: ChunkSaver,
        block_size: int,
    ) -> None:
        self.engine = engine
        self.counters = counters
        self.reports = reports
        self.saver = saver
        self.block_size = block_size

    @classmethod
    def idle(cls, counters: TransferCounters, reports: LoadReports) -> "Transfers":
        """The stand-in before registration: it moves nothing, and reports any load
        (none can have been planned without an engine) as failed."""
        return IdleTransfers(counters, reports)

    # -- loads --------------------------------------------------------------------------
    def start_step(self, meta: LMCacheConnectorMetadata) -> None:
        """The step's metadata is bound (before its forward pass)."""

    def load_step(self, meta: LMCacheConnectorMetadata) -> None:
        """The step's loads that run now, in ``start_load_kv``. Never raises."""
        for t in meta.loads:
            self.reports.blocks_failed(set(t.block_ids))  # no engine yet (never planned): recompute

    def _guarded(
        self, t: ChunkTransfer, meta: LMCacheConnectorMetadata, load: Callable[[ChunkTransfer, LMCacheConnectorMetadata], R]
    ) -> R | None:
        """``load(t, meta)`` in the step: a failure recomputes the request's blocks
        instead of reaching vLLM (None); the hit is unpinned either way."""
        try:
            return load(t, meta)
        except Exception as err:  # never crash vLLM: recompute instead
            log.warning("request %s: load failed, recomputing: %s: %s", t.req_id, type(err).__name__, err)
            self.fail(t, meta, 0)
            return None
        finally:
            self.complete_load(t.req_id)

    def _copy_chunks(
        self,
        t: ChunkTransfer,
        meta: LMCacheConnectorMetadata,
        shapes: list[tuple[int, ...]],
        dtype: torch.dtype,
        copy: Callable[[torch.Tensor, int, int], Any],
        hold: bool = False,
        flush: Callable[[], Any] | None = None,
    ) -> tuple[int, int]:
        """Read ``t``'s chunks in order (every tier in batches, lmcache_core.fetch) and
        ``copy(chunk, lo, hi)`` each into vLLM's blocks, until the first missing one:
        ``(tokens written, chunks copied)``. With ``hold`` the buffers are kept until
        ``layout.finish()`` (asynchronous device copies still read them); ``flush``
        runs after the last ``copy`` (a batched copy of what ``copy`` collected)."""
        loaded = got = 0
        held: list[Any] = []
        chunks = self.engine.iter_chunks(t.hashes, shapes, dtype)
        try:
            for i, buf in enumerate(chunks):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                try:
                    copy(buf.tensor, lo, hi)
                finally:
                    if hold:
                        held.append(buf)
                    else:
                        buf.release()
                loaded += hi - max(lo, t.write_from)
                got += 1
            if flush is not None:
                flush()
        finally:
            chunks.close()
            if held:
                self.layout.finish()
                for buf in held:
                    buf.release()
        return loaded, got

    def fail_all(self, meta: LMCacheConnectorMetadata) -> None:
        """Every load of the step reported failed (vLLM's KV memory is released)."""
        for t in meta.loads:
            self.fail(t, meta, 0)

    def _blocks_from(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata, from_chunk: int) -> set[int]:
        """The blocks that chunks ``from_chunk..`` of ``t`` write (from ``write_from`` on)."""
        lo = max(meta.chunk_start(t, from_chunk), t.write_from)
        hi = t.chunk_ends[-1]
        return set(t.block_ids[lo // self.block_size : -(-hi // self.block_size)])

    def fail(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata, from_chunk: int) -> set[int]:
        blocks = set(t.block_ids)
        self.reports.blocks_failed(blocks)
        return blocks

    def finished_loads(self, step_idle: bool) -> tuple[set[str], set[str]]:
        return self.reports.take_finished()

    def complete_load(self, req_id: str) -> None:
        """Release the pins the request's lookup took (:mod:`lmcache_core.pins`): the
        one place the worker side does, wherever the request's load ends: loaded or
        failed in the step (``_guarded``), on the load thread (``_load_background``),
        or never loaded (finished, aborted or preempted first: the plan's ``unpins``).
        A second call, or one for a request that holds no pins, does nothing."""
        self.engine.pins.release(req_id)

    # -- saves --------------------------------------------------------------------------
    def save_layer(self, layer_name: str, meta: LMCacheConnectorMetadata) -> None:
        """A layer's KV is written (``save_kv_layer``)."""

    def wait_layer(self, layer_name: str) -> None:
        """A layer is about to read its KV (``wait_for_layer_load``)."""

    def save_step(self, meta: LMCacheConnectorMetadata) -> None:
        """The step's saves, once every layer has written its KV. Never raises."""

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        return set()

    def save_logged(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        """Save one transfer: a failure is a skipped save, a future miss, never a crash."""
        try:
            self.save(t, meta)
        except Exception as err:
            log.warning("request %s: save failed, skipped: %s: %s", t.req_id, type(err).__name__, err)
            self.counters.add(skipped_saves=1)

    def save(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        """Gather and store one transfer's chunks (the idle stand-in stores nothing)."""

    # -- life ---------------------------------------------------------------------------
    def suspend(self) -> None:
        """Finish every copy that reads or writes vLLM's blocks (sleep mode)."""

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class IdleTransfers(Transfers):
    """The stand-in before vLLM registers its KV caches (:meth:`Transfers.idle`): no
    engine, no layout; loads are reported failed (none can have been planned), the
    rest does nothing."""

    def __init__(self, counters: TransferCounters, reports: LoadReports) -> None:
        self.counters = counters
        self.reports = reports
        self.block_size = 0

    def complete_load(self, req_id: str) -> None:
        """No engine: no lookup can have pinned anything."""


class DenseTransfers(Transfers):
    """One KV-cache group: chunks are slices of each layer's blocks."""

    kind = "dense"
    layout: BlockLayout | TokenLayout

    def __init__(
        self,
        engine: ConnectorEngine,
        layout: BlockLayout | TokenLayout,
        counters: TransferCounters,
        reports: LoadReports,
        saver: ChunkSaver,
        block_size: int,
        settings: ConnectorSettings,
        layer_names: list[str],
        save_cores: frozenset[int] | None = None,
    ) -> None:
        """``save_cores``: where the save thread runs when ``async_saves: auto`` chose
        background saves (then at nice 19; see ConnectorSettings.saves_on_spare_cores)."""
        super().__init__(engine, counters, reports, saver, block_size)
        self.layout = layout
        self.chunk_size = settings.core.chunk_size
        nice = settings.core.background_nice
        self.loads = LoadQueue(self._load_background, block_size, nice) if settings.async_loads else None
        self.saves: SaveQueue | None = None
        if settings.saves_on_spare_cores:
            self.saves = SaveQueue(self.save_logged, 19, cores=save_cores)
        elif settings.async_saves:
            self.saves = SaveQueue(self.save_logged, nice)
        self.pipeline = LayerPipeline(layout, layer_names) if settings.layerwise else None
        # On a GPU a transfer's chunks are copied together (layout.copy_many) and waited
        # for once; on CPU one at a time (one pool buffer in flight).
        self.batched = layout.device.type == "cuda"

    def _pipelined(self) -> LayerPipeline | None:
        return self.pipeline if self.pipeline is not None and self.pipeline.active else None

    # -- loads --------------------------------------------------------------------------
    def background(self, t: ChunkTransfer) -> bool:
        """Whether this load runs on the load thread (``async_loads``)."""
        return self.loads is not None and t.async_load

    def start_step(self, meta: LMCacheConnectorMetadata) -> None:
        # Asynchronous loads start now, before the forward pass they may overlap.
        if self.loads is not None:
            background = [t for t in meta.loads if self.background(t)]
            if background:
                self.loads.submit(meta, background)

    def load_step(self, meta: LMCacheConnectorMetadata) -> None:
        pipe = self._pipelined()
        items: list[LoadItem] = []
        for t in meta.loads:
            if self.background(t):
                continue  # handed to the load thread in start_step
            if pipe is not None:
                items += self._guarded(t, meta, self._read_for_pipeline) or []
            else:
                self._guarded(t, meta, self.load)
        if pipe is not None and items:
            try:
                pipe.load(items)
            except Exception as err:  # never crash vLLM: recompute every chunk of the step
                log.warning("layerwise load failed, recomputing: %s: %s", type(err).__name__, err)
                for t in meta.loads:
                    if not self.background(t):
                        self.fail(t, meta, 0)

    def fail_all(self, meta: LMCacheConnectorMetadata) -> None:
        for t in meta.loads:
            blocks = self.fail(t, meta, 0)
            if self.background(t):  # reported as a finished, failed load
                self.reports.blocks_failed(blocks)
                self.reports.finished(t.req_id)

    def fail(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata, from_chunk: int) -> set[int]:
        """Report the blocks of chunks ``from_chunk..`` so vLLM recomputes them.
        Returns the blocks; a background load's go back to the load thread, which
        reports them with the request's completion."""
        blocks = self._blocks_from(t, meta, from_chunk)
        if not self.background(t):
            self.reports.blocks_failed(blocks)
        self.counters.add(failed_loads=1)
        self.engine.record_load_errors(len(t.hashes) - from_chunk)
        return blocks

    def _load_background(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> set[int]:
        """One asynchronous load, on the load thread: the blocks that failed."""
        try:
            return self.load(t, meta)
        except Exception as err:  # never crash vLLM: recompute instead
            log.warning("request %s: load failed, recomputing: %s: %s", t.req_id, type(err).__name__, err)
            return self.fail(t, meta, 0)
        finally:
            self.complete_load(t.req_id)

    def load(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> set[int]:
        """Copy the chunks into vLLM's blocks: the blocks that failed to load."""
        t0 = time.perf_counter()
        failed: set[int] = set()
        batch = self.batched
        items: list[LoadItem] = []

        def copy(chunk: torch.Tensor, lo: int, hi: int) -> None:
            if batch:
                items.append(LoadItem(Borrowed(chunk), t.block_ids, lo, hi, t.write_from))
            else:
                self.layout.load_chunk(chunk, t.block_ids, lo, hi, t.write_from)

        loaded, got = self._copy_chunks(
            t,
            meta,
            self._chunk_shapes(t, meta),
            self.layout.dtype,
            copy,
            hold=batch,
            flush=(lambda: self.layout.copy_many(items, True)) if batch else None,
        )
        if got < len(t.hashes):
            failed = self.fail(t, meta, got)
        dt = time.perf_counter() - t0
        self.counters.loaded(loaded, dt)
        metrics.TIER_LATENCY.labels("connector", "load_request").observe(dt)
        return failed

    def _chunk_shapes(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> list[tuple[int, ...]]:
        return [self.layout.chunk_shape(meta.stored_tokens(t, i)) for i in range(len(t.hashes))]

    def _read_for_pipeline(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> list[LoadItem]:
        """layerwise: read a transfer's chunks from the cache (a miss fails the chunks
        from it on, as in :meth:`load`); the copies are enqueued by the pipeline."""
        t0 = time.perf_counter()
        items: list[LoadItem] = []
        loaded = 0
        for i, buf in enumerate(self.engine.iter_chunks(t.hashes, self._chunk_shapes(t, meta), self.layout.dtype)):
            lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
            items.append(LoadItem(buf, t.block_ids, lo, hi, t.write_from))
            loaded += hi - max(lo, t.write_from)
        if len(items) < len(t.hashes):
            self.fail(t, meta, len(items))
        self.counters.loaded(loaded, time.perf_counter() - t0)
        return items

    def finished_loads(self, step_idle: bool) -> tuple[set[str], set[str]]:
        done, failed = self.reports.take_finished()
        if self.loads is not None:
            if step_idle:
                self.loads.wait_idle(IDLE_WAIT_S)
            # A background load's failed blocks go out in this step's
            # get_block_ids_with_load_errors, with (never after) its completion.
            bg_done, bg_errors = self.loads.take()
            done |= bg_done
            self.reports.blocks_failed(bg_errors)
        return done, failed

    # -- layer by layer (layerwise) ------------------------------------------------------
    def wait_layer(self, layer_name: str) -> None:
        if self.pipeline is not None:
            self.pipeline.wait_layer(layer_name)

    def save_layer(self, layer_name: str, meta: LMCacheConnectorMetadata | None) -> None:
        pipe = self._pipelined()
        if pipe is None:
            return
        pipe.after_layer(layer_name)  # the next layers' loads, behind this layer's compute
        if not pipe.pending_saves() and (meta is None or not meta.saves):
            return
        try:
            pipe.save_layer(layer_name, lambda: self._plan_saves(meta) if meta is not None else [])
        except Exception as err:  # the step's saves are gathered in wait_for_save instead
            log.warning("layerwise save failed, gathering at the end of the step: %s: %s", type(err).__name__, err)
            for s in pipe.end_saves():
                s.buf.release()
            pipe.disable(f"save_kv_layer raised {type(err).__name__}")

    def _plan_saves(self, meta: LMCacheConnectorMetadata) -> list[SaveItem]:
        """layerwise: one pool buffer per chunk this step saves; a transfer whose
        buffers run out keeps the chunks before (a future miss after)."""
        items: list[SaveItem] = []
        for t in meta.saves:
            for i, h in enumerate(t.hashes):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                buf = self.engine.allocate(self.layout.chunk_shape(hi - lo), self.layout.dtype)
                if buf is None:
                    self.counters.add(skipped_saves=1)
                    break
                items.append(SaveItem(buf, t.block_ids, lo, hi, payload=(h, t.first_chunk + i < t.verify_below)))
        return items

    def _store_pipelined(self, pipe: LayerPipeline) -> None:
        """The chunks gathered layer by layer, stored."""
        t0 = time.perf_counter()
        saved = 0
        items = pipe.end_saves()
        try:
            for s in items:
                h, verify = s.payload
                if self.saver.store(h, s.buf, s.hi - s.lo, verify):
                    saved += s.hi - s.lo
        finally:
            for s in items:
                s.buf.release()
            self.counters.add(saved_tokens=saved, save_seconds=time.perf_counter() - t0)

    # -- saves --------------------------------------------------------------------------
    def save_step(self, meta: LMCacheConnectorMetadata) -> None:
        transfers = meta.saves
        if self.pipeline is not None:
            self.pipeline.end_loads()
            if self.pipeline.pending_saves():
                try:
                    self._store_pipelined(self.pipeline)
                except Exception as err:  # a failed save is a future miss
                    log.warning("layerwise saves failed, skipped: %s: %s", type(err).__name__, err)
                if self.saves is not None:  # stored here: done for the scheduler's count
                    self.saves.settled(transfers)
                transfers = []
        if self.saves is not None:
            self.saves.submit(meta, transfers)
            return
        for t in transfers:
            self.save_logged(t, meta)

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        return self.saves.finished(finished_req_ids) if self.saves is not None else set()

    def save(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        """Gather and store chunk by chunk: one pool buffer in flight at a time (on a
        GPU: the transfer's gathers enqueued together, waited for once, then stored)."""
        t0 = time.perf_counter()
        saved = 0
        batch = self.batched
        gathered: list[tuple[bytes, Any, int, bool]] = []
        pending: list[SaveItem] = []
        try:
            try:
                for i, h in enumerate(t.hashes):
                    lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                    buf = self.engine.allocate(self.layout.chunk_shape(hi - lo), self.layout.dtype)
                    if buf is None:  # pool exhausted by chunks in flight: a future miss
                        self.counters.add(skipped_saves=1)
                        break
                    verify = t.first_chunk + i < t.verify_below
                    if batch:
                        gathered.append((h, buf, hi - lo, verify))
                        pending.append(SaveItem(buf, t.block_ids, lo, hi))
                        continue
                    try:
                        self.layout.save_chunk(t.block_ids, lo, hi, buf.tensor)
                        if self.saver.store(h, buf, hi - lo, verify):
                            saved += hi - lo
                    finally:
                        buf.release()
                if pending:  # one kernel and a DMA per chunk (layout.copy_many)
                    self.layout.copy_many(pending, False)
            finally:
                if gathered:
                    self.layout.finish()  # before any buffer is read, stored or reused
            for h, buf, n, verify in gathered:
                if self.saver.store(h, buf, n, verify):
                    saved += n
        finally:
            for _, buf, _, _ in gathered:
                buf.release()
            self.counters.add(saved_tokens=saved, save_seconds=time.perf_counter() - t0)

    # -- life ---------------------------------------------------------------------------
    def suspend(self) -> None:
        if self.loads is not None:
            self.loads.drain()
        if self.saves is not None:
            self.saves.drain()
        if self.pipeline is not None:
            self.pipeline.end_loads()
            for s in self.pipeline.end_saves():
                s.buf.release()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"async_loads": self.loads.submitted if self.loads is not None else 0}
        if self.pipeline is not None:
            out["layerwise"] = {
                "active": self.pipeline.active,
                "loaded_chunks": self.pipeline.pipelined_loads,
                "saved_chunks": self.pipeline.pipelined_saves,
                "late_save_layers": self.pipeline.late_save_layers,
            }
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


class GroupedTransfers(Transfers):
    """Several KV-cache groups (hybrid models). A load is all chunks and the boundary
    object, or nothing: a recurrent state resumes exactly at its boundary, so a
    partial load fails the whole request (vLLM recomputes it). Loads vLLM was told
    are asynchronous are still copied in the step and reported finished."""

    kind = "grouped"
    layout: GroupedLayout

    def __init__(
        self,
        engine: ConnectorEngine,
        layout: GroupedLayout,
        counters: TransferCounters,
        reports: LoadReports,
        saver: ChunkSaver,
        block_size: int,
    ) -> None:
        super().__init__(engine, counters, reports, saver, block_size)
        self.layout = layout

    def load_step(self, meta: LMCacheConnectorMetadata) -> None:
        for t in meta.loads:
            self._guarded(t, meta, self.load)

    def fail(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata, from_chunk: int) -> set[int]:
        """An asynchronous load fails as a whole request (vLLM cannot take block-level
        errors for several groups); a synchronous one reports the blocks of chunks
        ``from_chunk..`` of its first group."""
        self.counters.add(failed_loads=1)
        self.engine.record_load_errors(len(t.hashes) - from_chunk)
        if t.async_load:
            self.reports.finished(t.req_id, failed=True)
            return set()
        blocks = self._blocks_from(t, meta, from_chunk)
        self.reports.blocks_failed(blocks)
        return blocks

    def load(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        assert t.group_block_ids is not None
        blocks = t.group_block_ids
        t0 = time.perf_counter()
        shapes = [self.layout.chunk_shape(meta.stored_tokens(t, i)) for i in range(len(t.hashes))]
        loaded, got = self._copy_chunks(
            t, meta, shapes, torch.uint8, lambda chunk, lo, hi: self.layout.load_chunk(chunk, blocks, lo, hi, t.write_from)
        )
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
        self.counters.loaded(loaded, dt)
        if t.async_load:
            self.reports.finished(t.req_id)
        metrics.TIER_LATENCY.labels("connector", "load_request").observe(dt)

    def save_step(self, meta: LMCacheConnectorMetadata) -> None:
        for t in meta.saves:
            self.save_logged(t, meta)

    def save(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        assert t.group_block_ids is not None
        blocks = t.group_block_ids
        t0 = time.perf_counter()
        saved = 0
        try:
            for i, h in enumerate(t.hashes):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                verify = t.first_chunk + i < t.verify_below

                def fill(out: Any, lo: int = lo, hi: int = hi) -> Any:
                    return self.layout.save_chunk(blocks, lo, hi, out)

                if self.saver.gather_and_store(h, self.layout.chunk_shape(hi - lo), torch.uint8, hi - lo, fill, verify):
                    saved += hi - lo
            for bh, end in t.boundaries:

                def fill_boundary(out: Any, end: int = end) -> Any:
                    return self.layout.save_boundary(blocks, end, out)

                self.saver.gather_and_store(bh, self.layout.boundary_shape(end), torch.uint8, 0, fill_boundary)
        finally:
            self.counters.add(saved_tokens=saved, save_seconds=time.perf_counter() - t0)
