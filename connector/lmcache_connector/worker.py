"""Worker side of the connector: owns the CacheEngine, answers lookups, and drives
the transfers between vLLM's paged KV tensors and the cache as the scheduler side
planned them.

The worker exists before vLLM hands over its KV tensors; ``register_kv_caches``
builds everything that needs them at once: the layout, the engine, and the one
:class:`~lmcache_connector.transfers.chunks.Transfers` object for the model's kind
(:class:`~lmcache_connector.transfers.chunks.DenseTransfers` or
:class:`~lmcache_connector.transfers.chunks.GroupedTransfers`), which owns the load and save
strategies (in the step, background threads, layer by layer). Until then every call
is a no-op. Nothing here may crash vLLM: a failed load marks its blocks for
recompute, a failed save is skipped.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Mapping, Sequence

import torch

from lmcache_core.engine import CacheEngine
from lmcache_core.keys import KeyNamespace
from lmcache_core.threads import use_background_cores

from .engine_api import ConnectorEngine
from .transfers.async_loads import LoadQueue
from .transfers.async_saves import SaveQueue
from .layouts.grouped_layout import GroupedLayout
from .protocol.kv_events import RawEvent, TierEventBuffer
from .layouts.groups import FULL, GroupPlan
from .layouts.kv_adapters import BlockLayout, TokenLayout, make_layout, transfer_path
from .transfers.layerwise import LayerPipeline
from .features.cpu_cores import background_cores
from .features.hits import HitPlanner
from .features.load_policy import PrefillModel
from .protocol.lookup_ipc import LookupAnswer, LookupServer
from .protocol.metadata import LMCacheConnectorMetadata
from .protocol.stats import DeltaReporter
from .options import AUTO, ConnectorSettings
from .transfers.chunks import (
    ChunkSaver,
    DenseTransfers,
    GroupedTransfers,
    LoadReports,
    TransferCounters,
    Transfers,
)

from .log import get_logger

log = get_logger(__name__)

# The per-layer KV layout contract the fingerprint is relative to: vLLM 0.32's [B, H, N, C]
# views in a KVCacheLayout order (0.33 keeps it). Change it when vLLM changes what they hold.
VLLM_TAG = "vllm-0.32"


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
        self.kv_events = kv_events
        self.replicated = replicated
        # built by register_kv_caches
        self.layout: BlockLayout | TokenLayout | GroupedLayout | None = None
        self.engine: ConnectorEngine | None = None
        self.hits: HitPlanner | None = None
        self.server: LookupServer | None = None
        self.tier_events: TierEventBuffer | None = None
        self.totals = TransferCounters()
        self.reports = LoadReports()
        self.transfers: Transfers = Transfers.idle(self.totals, self.reports)  # until register_kv_caches
        # load_policy: the engine's compute time per step, timed here (see load_policy.py)
        self.prefill = PrefillModel()
        self._fwd_start: float | None = None
        self._step_load_s = 0.0
        self._reported = DeltaReporter()
        self._step_idle = False  # this step computes nothing (async_loads: wait for loads instead of spinning)
        self.suspended = False  # vLLM's sleep mode: the KV tensors are released; no copy touches them

    # -- the dense strategies, for tests and tools (None for grouped models) -----------
    @property
    def loads(self) -> LoadQueue | None:
        return self.transfers.loads

    @property
    def saves(self) -> SaveQueue | None:
        return self.transfers.saves

    @property
    def pipeline(self) -> LayerPipeline | None:
        return self.transfers.pipeline

    # -- set-up -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layout, dtype, value_dtype = self._layout(kv_caches)
        ns = KeyNamespace(
            model=self.model_id,
            layout=f"{VLLM_TAG}/{layout.fingerprint()}",
            dtype=dtype,
            world_size=1 if self.replicated else self.world_size,
            rank=0 if self.replicated else self.rank,
        )
        spare = self._spare_cores()
        engine: ConnectorEngine = CacheEngine(
            self.settings.loaded, namespace=ns, shared_writes=not self.replicated or self.rank == 0
        )
        if self.kv_events:
            ranks = [dataclasses.replace(engine.namespace, rank=r).id for r in range(ns.world_size)]
            self.tier_events = TierEventBuffer(self.rank, ranks)
            engine.add_listener(self.tier_events)
        transfers = self._transfers(engine, layout, ChunkSaver(engine, self.totals, value_dtype), list(kv_caches), spare)
        chunk_shape = tuple(layout.chunk_shape(self.cfg.chunk_size))
        chunk_dtype = torch.uint8 if isinstance(layout, GroupedLayout) else layout.dtype
        self.hits = HitPlanner(
            engine,
            chunk_size=self.cfg.chunk_size,
            chunk_shape=chunk_shape,
            chunk_dtype=chunk_dtype,
            load_policy=self.cfg.connector.load_policy,
            load_margin=self.cfg.connector.load_margin,
            prefill=self.prefill,
            boundary=self.plan is not None and self.plan.has_boundary,
            background=self.settings.async_loads == AUTO and transfers.loads is not None,
        )
        self.layout, self.engine, self.transfers = layout, engine, transfers
        # the config's preload, if any; its summary in vLLM's log
        engine.preload(
            chunk_dtype, math.prod(chunk_shape) * chunk_dtype.itemsize, lambda r: log.info("lmcache-core: %s", r.describe())
        )
        tiers = engine.tier_report()
        log.info(
            "lmcache-core: %s layout, chunk %d tokens, tiers %s, transfer path %s%s",
            layout.kind,
            self.cfg.chunk_size,
            [t.name for t in tiers],
            transfer_path(layout.device),
            f", KV-cache groups: {self.plan.describe()}" if self.plan is not None and self.plan.hybrid else "",
        )
        if self.lookup_address:
            # Memory-only tiers: a scheduler in this process may call the lookup directly.
            self.server = LookupServer(
                self.lookup_address,
                self._lookup,
                inline=all(t.zero_copy for t in tiers),
                release=lambda rid: self.transfers.complete_load(rid),
            )

    def _layout(self, kv_caches: dict[str, Any]) -> tuple[BlockLayout | TokenLayout | GroupedLayout, str, torch.dtype | None]:
        """The layout over vLLM's KV caches, the dtype that names the namespace, and
        (several KV-cache groups) the full-attention layers' value dtype, if one."""
        if self.plan is None or not self.plan.hybrid:
            layout = make_layout(self.cfg.connector.layout, kv_caches, self.block_size)
            return layout, str(layout.dtype).removeprefix("torch."), None
        grouped = GroupedLayout(kv_caches, self.plan, self._page_bytes, self._real_bytes)
        dtype = "+".join(sorted({_dtype_of(t) for t in kv_caches.values()}))
        full = {
            t.dtype for g in self.plan.of_kind(FULL) for n in g.layer_names for t in [kv_caches[n]] if isinstance(t, torch.Tensor)
        }
        return grouped, dtype, full.pop() if len(full) == 1 else None

    def _spare_cores(self) -> frozenset[int] | None:
        """The cores the model is not bound to: for ``background_cores: auto`` (taken
        here), and for the save thread when ``async_saves: auto`` chose background saves."""
        if self.cfg.background_cores != "auto" and not self.settings.saves_on_spare_cores:
            return None
        spare = background_cores(self.world_size)
        if self.cfg.background_cores == "auto":
            use_background_cores(spare)
            if spare is not None:
                log.info(
                    "lmcache-core: background transfers run on cores %s, off the model's cores %s",
                    sorted(spare),
                    sorted(os.sched_getaffinity(0)),
                )
        return spare

    def _transfers(
        self,
        engine: ConnectorEngine,
        layout: BlockLayout | TokenLayout | GroupedLayout,
        saver: ChunkSaver,
        layer_names: list[str],
        spare: frozenset[int] | None,
    ) -> Transfers:
        """The transfers object for the layout (the only place that picks one)."""
        if isinstance(layout, GroupedLayout):
            if self.settings.layerwise:
                log.info("lmcache-core: layerwise has no effect with several KV-cache groups (whole-step copies)")
            return GroupedTransfers(engine, layout, self.totals, self.reports, saver, self.block_size)
        save_cores = None
        if self.settings.saves_on_spare_cores:  # async_saves: auto chose background saves
            save_cores = spare
            log.info(
                "lmcache-core: saves run in the background (async_saves: auto) on cores %s at nice 19",
                sorted(save_cores) if save_cores else "of the model",
            )
        return DenseTransfers(
            engine, layout, self.totals, self.reports, saver, self.block_size, self.settings, layer_names, save_cores=save_cores
        )

    def _lookup(self, hashes: Sequence[bytes], pin_id: str | None, alts: Mapping[int, bytes] | None = None) -> LookupAnswer:
        """The scheduler's lookup: chunks still in a background save are waited for
        (briefly, see async_saves.LOOKUP_WAIT_S) before the answer, which says
        ``saving`` when some still were (the scheduler asks again a step later)."""
        assert self.hits is not None
        saving = self.saves is not None and not self.saves.wait_for_chunks(hashes)
        answer = self.hits.lookup(hashes, pin_id, alts)
        return dataclasses.replace(answer, saving=True) if saving else answer

    # -- a step ------------------------------------------------------------------------
    def step_started(self, meta: LMCacheConnectorMetadata | None = None) -> None:
        """vLLM bound this step's metadata: its forward pass runs from now until
        ``wait_for_save`` (minus synchronous loads), timed for load_policy. vLLM calls
        ``start_load_kv`` before the forward only when a step has synchronous loads,
        otherwise after it, so the binding is the only reliable start. Background
        saves that may read blocks freed by a preemption finish here, before any
        write of the step; background loads start here."""
        if self.saves is not None and meta is not None and meta.freed_early:
            self.saves.forget(meta.freed_early)  # before this step's get_finished
        if self.saves is not None and meta is not None and meta.drain_saves:
            self.saves.drain()
        self._step_idle = meta is not None and meta.step_tokens == 0
        if meta is not None and not self.suspended:
            self.transfers.start_step(meta)
        self._fwd_start = time.perf_counter()
        self._step_load_s = 0.0

    def start_load_kv(self, meta: LMCacheConnectorMetadata) -> None:
        transfers = self.transfers
        if self.suspended:  # vLLM's KV memory is released: report every load failed (recompute)
            transfers.fail_all(meta)
            for rid in {t.req_id for t in meta.loads} | set(meta.unpins):  # pins are released asleep too
                transfers.complete_load(rid)
            return
        t_start = time.perf_counter()
        transfers.load_step(meta)
        for rid in meta.unpins:
            transfers.complete_load(rid)
        if self._fwd_start is not None:  # loads are not compute: keep them out of the step's time
            self._step_load_s += time.perf_counter() - t_start

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.transfers.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, meta: LMCacheConnectorMetadata | None) -> None:
        if meta is not None and not self.suspended:
            self.transfers.save_layer(layer_name, meta)

    def wait_for_save(self, meta: LMCacheConnectorMetadata) -> None:
        if self.suspended:  # no block is read while vLLM sleeps: the step's saves are dropped
            if self.saves is not None:
                self.saves.settled(meta.saves)  # (the scheduler waits for each it planned)
            return
        if self._fwd_start is not None and meta.step_tokens > 0:
            self.prefill.record(meta.step_tokens, meta.step_pairs, time.perf_counter() - self._fwd_start - self._step_load_s)
        self._fwd_start = None
        self.transfers.save_step(meta)
        if meta.retain and self.engine is not None:  # retention hints (lmcache_core.retention): what this step moved
            for t in (*meta.loads, *meta.saves):
                hint = meta.retain.get(t.req_id)
                if hint is not None:
                    self.engine.retain(t.hashes, hint[0], hint[1])

    # -- what vLLM asks after a step ------------------------------------------------------
    def take_tier_events(self) -> list[RawEvent]:
        """Tier stores and evictions since the last call (KV events)."""
        return self.tier_events.take() if self.tier_events is not None else []

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.reports.take_errors()

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads completed since the last call: (finished, failed); failed
        ones are in both sets, as vLLM expects."""
        return self.transfers.finished_loads(self._step_idle)

    def take_finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose background saves are all done (``finished_sending``)."""
        return self.transfers.finished_saves(finished_req_ids)

    # -- metrics ------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Cumulative counters, flat, as shipped to vLLM's metrics."""
        c = self.totals
        out: dict[str, float] = {
            "loaded_tokens": c.loaded_tokens,
            "saved_tokens": c.saved_tokens,
            "bypassed_tokens": self.hits.bypassed_tokens if self.hits is not None else 0,
            "verified_chunks": c.verified_chunks,
            "verify_inexact": c.verify_inexact,
            "load_seconds": c.load_seconds,
            "save_seconds": c.save_seconds,
        }
        if self.engine is not None:
            e = self.engine.counters.snapshot()
            out.update(
                lookups=e["lookups"], lookup_tokens=e["lookup_tokens"], hit_tokens=e["hit_tokens"], load_errors=e["load_errors"]
            )
            for tier in self.engine.tier_report():
                # the engine's own counts of the tier, whatever its stats do
                out[f"tier_errors/{tier.name}"] = e["backend_errors"].get(tier.name, 0)
                out[f"verify_mismatches/{tier.name}"] = e["verify_mismatches"].get(tier.name, 0)
                out[f"tier_quarantined/{tier.name}"] = int(tier.quarantined)
                st = tier.stats
                if st is None:  # a broken tier's stats: none this step (their totals are kept, see DeltaReporter)
                    continue
                out[f"tier_put_bytes/{tier.name}"] = st.put_bytes
                out[f"tier_get_bytes/{tier.name}"] = st.get_bytes
                out[f"tier_evictions/{tier.name}"] = st.evictions
                out[f"tier_used_bytes/{tier.name}"] = st.bytes_used
                out[f"tier_capacity_bytes/{tier.name}"] = st.bytes_capacity or 0
                if "retained_bytes" in st.extra:  # a tier that takes retention hints
                    out[f"tier_retained_bytes/{tier.name}"] = st.extra["retained_bytes"]
                    out[f"tier_retention_kept/{tier.name}"] = st.extra["retention_kept"]
        return out

    def take_stats_delta(self) -> dict[str, float]:
        """Counter increments since the previous call (vLLM sums these)."""
        return self._reported.delta(self.counters())

    # -- sleep mode (vLLM >= 0.33: unregister_kv_caches / restore_kv_caches) ------------
    def suspend(self) -> None:
        """Before vLLM releases the KV cache memory: finish every copy that reads or
        writes vLLM's blocks (background loads and saves, the layer pipeline), then
        touch no block until :meth:`resume`. Steps in between load and save nothing
        (a hit is then recomputed). What the tiers hold stays valid. Idempotent."""
        self.transfers.suspend()
        self.suspended = True

    def resume(self) -> None:
        """After wake-up: vLLM's KV tensors are the same objects at the same addresses
        (vLLM's sleep allocator keeps them), so the layouts stay valid. Idempotent."""
        self.suspended = False

    # -- housekeeping -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        c = self.totals
        out: dict[str, Any] = {
            "loaded_tokens": c.loaded_tokens,
            "saved_tokens": c.saved_tokens,
            "failed_loads": c.failed_loads,
            "skipped_saves": c.skipped_saves,
            "bypassed_tokens": self.hits.bypassed_tokens if self.hits is not None else 0,
            "bypassed_lookups": self.hits.bypassed_lookups if self.hits is not None else 0,
            "load_policy": self.hits.load_policy if self.hits is not None else self.cfg.connector.load_policy,
            "verified_chunks": c.verified_chunks,
            "verify_inexact": c.verify_inexact,
            "async_loads": 0,
        }
        out.update(self.transfers.stats())
        if self.engine is not None:
            out["engine"] = self.engine.stats()
        return out

    def close(self) -> None:
        self.transfers.close()
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.engine is not None:
            self.engine.flush(timeout=10)
            self.engine.close()
