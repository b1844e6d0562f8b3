"""``LMCacheCoreConnector``: the vLLM v1 KV connector (vLLM 0.32.0).

A thin facade: vLLM builds one instance per role; the scheduler role delegates to
:class:`~lmcache_connector.scheduler.SchedulerSide` (one object per mode), the worker role to
:class:`~lmcache_connector.worker.WorkerSide`. Load it with::

    KVTransferConfig(kv_connector="LMCacheCoreConnector",
                     kv_connector_module_path="lmcache_connector",  # optional once installed
                     kv_role="kv_both",
                     kv_load_failure_policy="recompute")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_core.config import ConfigError

from .features import settle
from .features.cpu_cores import auto_async_saves, reservation_advice
from .protocol.kv_events import EventTranslator, LMCacheCoreKVEvents, event_groups, events_enabled
from .layouts.groups import GroupPlan, UnsupportedGroupError, describe_groups, effective_chunk_size, state_advice
from .protocol.lookup_ipc import LookupClient, socket_path
from .protocol.metadata import LMCacheConnectorMetadata, SaveProgress
from .options import ConnectorSettings, load_settings
from .scheduler import SchedulerSide, make_scheduler
from .protocol.stats import LMCacheConnectorStats, LMCachePromMetrics
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

from .log import get_logger

log = get_logger(__name__)


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group
    except AssertionError:  # world group not initialised (single process tools)
        return 0


def _page_sizes(kv_cache_config: Any, plan: GroupPlan) -> tuple[dict[int, int], dict[int, int]]:
    """Each group's page size in vLLM's pool and the bytes of it that hold data."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    page, real = {}, {}
    for g in plan.groups:
        if g.index < len(groups):
            spec = groups[g.index].kv_cache_spec
            page[g.index] = int(spec.page_size_bytes)
            real[g.index] = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
    return page, real


def _fit_chunk_size(settings: ConnectorSettings, plan: GroupPlan) -> ConnectorSettings:
    """``settings`` with the chunk size this model needs (a multiple of each group's
    block size), said in a warning when it differs from the configured one."""
    chunk = effective_chunk_size(settings.core.chunk_size, plan)
    if chunk == settings.core.chunk_size:
        return settings
    log.warning(
        "lmcache-core: chunk_size %d (from %s) is not a multiple of vLLM's block size %d for this model: using %d",
        settings.core.chunk_size,
        settings.loaded.source_of("chunk_size"),
        plan.token_block_size(),
        chunk,
    )
    return settings.with_chunk_size(chunk)


def _replicated(vllm_config: "VllmConfig") -> bool:
    """MLA: the latent KV is the same on every tensor-parallel rank; stored once."""
    return vllm_config.parallel_config.world_size > 1 and bool(getattr(vllm_config.model_config, "use_mla", False))


def _engine_id(vllm_config: "VllmConfig") -> str:
    ktc = vllm_config.kv_transfer_config
    return (ktc.engine_id if ktc is not None else None) or "default"


def _scheduler_side(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", settings: ConnectorSettings, plan: GroupPlan
) -> SchedulerSide:
    """The scheduler role's side: start-up advice logged, lookups to every rank."""
    # vLLM's scheduler module is loaded in this process already; not in a worker's
    from .state_scheduler import is_state_scheduler  # noqa: PLC0415

    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    cfg = settings.core
    conn = cfg.connector
    world = vllm_config.parallel_config.world_size
    state_sched = is_state_scheduler(vllm_config.scheduler_config.scheduler_cls)
    settles, settle_advice = settle.resolve(
        conn.save_decode_cache,
        has_state=plan.has_state,
        state_scheduler=state_sched,
        can_load=ktc.is_kv_consumer,
        can_save=ktc.is_kv_producer,
    )
    for advice in (reservation_advice(vllm_config), state_advice(plan, cfg.chunk_size, state_sched), settle_advice):
        if advice:
            log.warning("lmcache-core: %s", advice)
    client = LookupClient([socket_path(_engine_id(vllm_config), r) for r in range(world)], conn.lookup_timeout_s)
    events = None
    if events_enabled(vllm_config):
        events = EventTranslator(
            chunk_size=cfg.chunk_size,
            hash_block_size=getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size,
            writers=[0] if _replicated(vllm_config) else range(world),
            groups=event_groups(kv_cache_config, plan),
        )
    return make_scheduler(
        settings,
        block_size=plan.token_block_size(),
        can_load=ktc.is_kv_consumer,
        can_save=ktc.is_kv_producer,
        lookup=client,
        plan=plan,
        settle=settles,
        events=events,
    )


def _worker_side(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", settings: ConnectorSettings, plan: GroupPlan
) -> WorkerSide:
    """The worker role's side for this process's rank (its engine starts once vLLM
    registers the KV caches)."""
    rank = _rank()
    return WorkerSide(
        settings,
        model_id=settings.model_id or str(vllm_config.model_config.model),
        block_size=plan.token_block_size(),
        rank=rank,
        world_size=vllm_config.parallel_config.world_size,
        lookup_address=socket_path(_engine_id(vllm_config), rank),
        plan=plan,
        pages=_page_sizes(kv_cache_config, plan),
        kv_events=events_enabled(vllm_config),
        replicated=_replicated(vllm_config),
    )


class LMCacheCoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager (``SupportsHMA``): models with
    sliding-window, full-attention and state-space layers keep their per-group
    caches; see :mod:`lmcache_connector.layouts.groups`."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc is None:  # vLLM builds connectors only from a kv_transfer_config
            raise ConfigError("LMCacheCoreConnector: vLLM gave no kv_transfer_config")
        settings = load_settings(ktc.kv_connector_extra_config).for_engine(auto_async_saves(vllm_config))
        try:
            self.plan = plan = describe_groups(kv_cache_config, vllm_config.cache_config.block_size)
        except UnsupportedGroupError as err:
            raise ConfigError(f"LMCacheCoreConnector: {err}") from None
        self.settings = settings = _fit_chunk_size(settings, plan)
        if plan.hybrid and settings.core.connector.save_unfull_chunk:
            log.info("lmcache-core: save_unfull_chunk has no effect with several KV-cache groups (whole chunks only)")
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _scheduler_side(vllm_config, kv_cache_config, settings, plan)
        else:
            self._worker = _worker_side(vllm_config, kv_cache_config, settings, plan)

    @property
    def worker(self) -> WorkerSide | None:
        """This process's worker side (its engine, ``stats()``, queues), or None in the
        scheduler role. With vLLM's engine in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
        the demo, the tests and the benchmarks reach it as
        ``get_kv_transfer_group().worker``; read-only: vLLM drives its life."""
        return self._worker

    def lmcache_state_chunk_size(self) -> int:
        """The chunk size to align prefill steps to when this (scheduler-side)
        connector serves a model with state-space layers, else 0: what the state
        scheduler (``state_scheduler.StateBoundaryScheduler``) asks."""
        side = self._sched
        plan = side.plan if side is not None else None
        return int(side.cs) if side is not None and plan is not None and plan.has_state else 0

    def lmcache_take_settles(self, idle: bool = True, budget: int | None = None) -> "list[settle.SettlePlan]":
        """Internal requests to run (``connector.save_decode_cache: prefill``): what the
        state scheduler asks after each step, saying whether the engine is ``idle``
        (no request running or waiting) and how many tokens a step schedules
        (features/settle.py)."""
        return self._sched.take_settles(idle, budget) if self._sched is not None else []

    def lmcache_settle_dropped(self, req_id: str) -> None:
        """The state scheduler could not add settle ``req_id``."""
        if self._sched is not None:
            self._sched.settle_dropped(req_id)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM >= 0.33 asks before enabling sleep mode with a connector."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33, before sleep: every copy touching vLLM's blocks finished, none
        started until :meth:`restore_kv_caches`."""
        if self._worker is not None:
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33, after wake-up."""
        if self._worker is not None:
            self._worker.resume()

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started(connector_metadata if isinstance(connector_metadata, LMCacheConnectorMetadata) else None)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads complete in start_load_kv (or in the background: async_loads), except
        # with layerwise on a GPU: the compute stream then waits for this layer's copies.
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        # Saves gather every layer at once in wait_for_save, except with layerwise:
        # this layer's gather is enqueued now (on a side stream on GPUs).
        if self._worker is not None and self._worker.pipeline is not None:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            self._worker.save_kv_layer(layer_name, meta if isinstance(meta, LMCacheConnectorMetadata) else None)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheConnectorMetadata)
        self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads completed since the last step (multi-group models: a
        failed one is recomputed by vLLM as a whole request; dense models with
        ``async_loads``: its failed blocks are in this step's
        ``get_block_ids_with_load_errors``), and finished requests whose background
        saves are done (``async_saves``: vLLM frees their blocks now). (``get_finished`` is left to the base
        class: it cannot say "failed", and vLLM 0.32 reads this method.)"""
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.take_finished_loads()
        sent = self._worker.take_finished_saves(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def get_kv_connector_stats(self) -> "LMCacheConnectorStats | None":
        """This step's counter increments: the worker's, or on the scheduler the
        settles' (vLLM adds both)."""
        side = self._worker if self._worker is not None else self._sched
        delta = side.take_stats_delta() if side is not None else None
        return LMCacheConnectorStats(data=delta) if delta else None

    def get_kv_connector_kv_cache_events(self) -> LMCacheCoreKVEvents | None:
        """This step's tier stores and evictions (translated on the scheduler)."""
        if self._worker is None:
            return None
        raw = self._worker.take_tier_events()
        return LMCacheCoreKVEvents(raw) if raw else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> "LMCacheConnectorStats":
        return LMCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LMCachePromMetrics:
        return LMCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._sched is None:
            return
        if connector_output.failed_recving:
            self._sched.loads_failed(sorted(connector_output.failed_recving))
        if self._sched.async_loads:
            self._sched.async_loads_reported(connector_output.finished_recving, connector_output.invalid_block_ids)
        if self._sched.events is not None and connector_output.kv_cache_events is not None:
            self._sched.events.add(connector_output.kv_cache_events)
        progress = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(progress, SaveProgress):
            self._sched.saves_progress(progress.done)

    def build_connector_worker_meta(self) -> "SaveProgress | None":
        """``async_saves``: how far each request's background saves got (SaveProgress),
        every step, so the scheduler frees a finished request's blocks at once when
        they are all done."""
        if self._worker is None or self._worker.saves is None:
            return None
        return SaveProgress(self._worker.saves.progress())

    def take_events(self) -> "list[KVCacheEvent]":
        """KV events for what lmcache-core's tiers stored and evicted (see kv_events.py)."""
        if self._sched is None or self._sched.events is None:
            return []
        return self._sched.events.take()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)
