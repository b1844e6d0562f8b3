"""Worker side of the connector: owns the CacheEngine and moves KV between vLLM's
paged tensors and the cache, as the scheduler side planned.

Loads are synchronous in ``start_load_kv`` (vLLM calls it before the forward pass
when a step has synchronous loads). Saves gather in ``wait_for_save``, after every
layer of the step has written its KV, into pool buffers the CPU tier adopts without a
copy; slower tiers are written in the background by the engine. Nothing here may
crash vLLM: a failed load marks its blocks for recompute, a failed save is skipped.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch

from lmcache_core import metrics as m
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import KeyNamespace

from .layout import BlockLayout, TokenLayout, make_layout, transfer_path
from .lookup_ipc import LookupServer
from .metadata import ChunkTransfer, LMCacheConnectorMetadata
from .options import ConnectorSettings

from .log import get_logger

log = get_logger(__name__)

VLLM_TAG = "vllm-0.32"
_active: "weakref.WeakSet[WorkerSide]" = weakref.WeakSet()


def active_workers() -> list["WorkerSide"]:
    """Worker sides alive in this process (tests and the demo read their stats)."""
    return list(_active)


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
    ) -> None:
        self.settings = settings
        self.cfg = settings.core
        self.model_id = model_id
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.lookup_address = lookup_address
        self.layout: BlockLayout | TokenLayout | None = None
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
        self._reported: dict[str, float] = {}
        _active.add(self)

    # -- set-up -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layout = make_layout(self.cfg.layout, kv_caches, self.block_size)
        ns = KeyNamespace(
            model=self.model_id,
            layout=f"{VLLM_TAG}/{self.layout.fingerprint()}",
            dtype=str(self.layout.dtype).removeprefix("torch."),
            world_size=self.world_size,
            rank=self.rank,
        )
        self.engine = CacheEngine(self.settings.loaded, namespace=ns)
        log.info(
            "lmcache-core: %s layout, chunk %d tokens, tiers %s, transfer path %s",
            self.layout.kind,
            self.cfg.chunk_size,
            [t.name for t in self.engine.tiers],
            transfer_path(self.layout.device),
        )
        if self.lookup_address:
            self.server = LookupServer(self.lookup_address, self._lookup)

    def _lookup(self, hashes: list[bytes], pin_id: str | None) -> int:
        assert self.engine is not None
        return self.engine.lookup_hashes(hashes, pin_id=pin_id)

    # -- loads --------------------------------------------------------------------------
    def start_load_kv(self, meta: LMCacheConnectorMetadata) -> None:
        if self.engine is None:
            return
        for t in meta.loads:
            try:
                self._load(t, meta)
            except Exception as err:  # never crash vLLM: recompute instead
                log.warning("request %s: load failed, recomputing: %s: %s", t.req_id, type(err).__name__, err)
                self._fail(t, meta, 0)
            finally:
                self.engine.unpin(t.req_id)
        for rid in meta.unpins:
            self.engine.unpin(rid)

    def _load(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        assert self.engine is not None and self.layout is not None
        t0 = time.perf_counter()
        loaded = 0
        for i, h in enumerate(t.hashes):
            lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
            buf = self.engine.retrieve_buffer(h, self.layout.chunk_shape(hi - lo), self.layout.dtype)
            if buf is None:
                self._fail(t, meta, i)
                break
            try:
                self.layout.load_chunk(buf.tensor, t.block_ids, lo, hi, t.write_from)
            finally:
                buf.release()
            loaded += hi - max(lo, t.write_from)
        dt = time.perf_counter() - t0
        with self._lock:
            self.loaded_tokens += loaded
            self.load_seconds += dt
        m.LOADED_TOKENS.inc(loaded)
        m.TIER_LATENCY.labels("connector", "load_request").observe(dt)

    def _fail(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata, from_chunk: int) -> None:
        """Report the blocks of chunks ``from_chunk..`` so vLLM recomputes them."""
        lo = max(meta.chunk_start(t, from_chunk), t.write_from)
        hi = t.chunk_ends[-1]
        blocks = t.block_ids[lo // self.block_size : -(-hi // self.block_size)]
        with self._lock:
            self._errors.update(blocks)
            self.failed_loads += 1
        m.LOAD_ERRORS.inc(len(t.hashes) - from_chunk)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errs, self._errors = self._errors, set()
        return errs

    # -- saves --------------------------------------------------------------------------
    def wait_for_save(self, meta: LMCacheConnectorMetadata) -> None:
        if self.engine is None:
            return
        for t in meta.saves:
            try:
                self._save(t, meta)
            except Exception as err:  # a lost save is a future miss, never a crash
                log.warning("request %s: save failed, skipped: %s: %s", t.req_id, type(err).__name__, err)
                with self._lock:
                    self.skipped_saves += 1

    def _save(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        """Gather and store chunk by chunk: one pool buffer in flight at a time."""
        assert self.engine is not None and self.layout is not None
        t0 = time.perf_counter()
        saved = 0
        try:
            for i, h in enumerate(t.hashes):
                lo, hi = meta.chunk_start(t, i), t.chunk_ends[i]
                buf = self.engine.allocate(self.layout.chunk_shape(hi - lo), self.layout.dtype)
                if buf is None:  # pool exhausted by chunks in flight: a future miss
                    with self._lock:
                        self.skipped_saves += 1
                    break
                try:
                    self.layout.save_chunk(t.block_ids, lo, hi, buf.tensor)
                    if self.engine.store_hashes([h], [buf], n_tokens=hi - lo):
                        saved += hi - lo
                finally:
                    buf.release()
        finally:
            with self._lock:
                self.saved_tokens += saved
                self.save_seconds += time.perf_counter() - t0

    # -- metrics ------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Cumulative counters, flat, as shipped to vLLM's metrics."""
        out: dict[str, float] = {
            "loaded_tokens": self.loaded_tokens,
            "saved_tokens": self.saved_tokens,
            "load_errors": self.failed_loads,
            "load_seconds": self.load_seconds,
            "save_seconds": self.save_seconds,
        }
        if self.engine is not None:
            c = self.engine.counters.snapshot()
            out.update(lookups=c["lookups"], lookup_tokens=c["lookup_tokens"], hit_tokens=c["hit_tokens"])
            for tier in self.engine.tiers:
                try:
                    s = tier.stats()
                except Exception:  # a broken tier reports nothing this step
                    continue
                out[f"tier_put_bytes/{tier.name}"] = s.put_bytes
                out[f"tier_get_bytes/{tier.name}"] = s.get_bytes
                out[f"tier_evictions/{tier.name}"] = s.evictions
                out[f"tier_errors/{tier.name}"] = c["backend_errors"].get(tier.name, 0)
        return out

    def take_stats_delta(self) -> dict[str, float]:
        """Counter increments since the previous call (vLLM sums these)."""
        now = self.counters()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return {k: v for k, v in delta.items() if v}

    # -- housekeeping -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "loaded_tokens": self.loaded_tokens,
            "saved_tokens": self.saved_tokens,
            "failed_loads": self.failed_loads,
            "skipped_saves": self.skipped_saves,
        }
        if self.engine is not None:
            out["engine"] = self.engine.stats()
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.engine is not None:
            self.engine.flush(timeout=10)
            self.engine.close()
        _active.discard(self)
