"""Loads off the forward path (``connector.async_loads: true``, dense models), on vLLM's
asynchronous load contract.

The scheduler side answers a hit with ``load_kv_async=True``: vLLM allocates the
request's blocks, parks it in ``WAITING_FOR_REMOTE_KVS`` (it is not scheduled, and
its blocks are not in vLLM's prefix cache yet) and sends the load in the next step's
metadata. The worker hands it to one background thread as soon as the step's
metadata is bound, before the forward pass, so the copies into the request's blocks
overlap the other requests' forward passes. The thread reports each load in
``finished_recving`` (``get_transfer_results``); vLLM then schedules the request in
a later step. The blocks a load writes belong to that request alone until then:

* a chunk missing or unreadable: the load stops there and the blocks from that chunk
  on are reported in ``get_block_ids_with_load_errors`` together with (never after)
  the request's ``finished_recving``; vLLM (``kv_load_failure_policy: recompute``)
  keeps the prefix that loaded and recomputes the rest;
* an aborted request: vLLM holds its blocks until the load is reported finished,
  so the thread finishes (or fails) the load and reports it as usual;
* the chunks a load reads stay pinned until the thread has read them.

A step with nothing to compute (every admitted request waits for its load) would
otherwise return at once and vLLM would run the next empty step right away, spinning
on the cores the copies need: such a step waits up to ``IDLE_WAIT_S`` for the loads in
flight, so their completion is reported in that step.

Multi-group (hybrid) models keep their own path: their loads are reported through
``finished_recving`` too, but copied in ``start_load_kv``, and a failure fails the whole
request (vLLM cannot take block-level errors for several groups).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..log import get_logger
from ..protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata
from .transfer_queue import TransferQueue

log = get_logger(__name__)

IDLE_WAIT_S = 0.02

# load(transfer, meta) -> block ids that failed to load (empty: all loaded)
LoadFn = Callable[[ChunkTransfer, LMCacheConnectorMetadata], set[int]]


class LoadQueue(TransferQueue):
    """One background thread running ``load(transfer, meta)`` in submission order;
    :meth:`take` hands back the finished requests and their failed blocks together."""

    thread_name = "lmcache-async-loads"

    def __init__(self, load: LoadFn, block_size: int, nice: int = 0) -> None:
        super().__init__(nice)
        self._load = load
        self._block_size = block_size
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._done: set[str] = set()
        self._errors: set[int] = set()
        self.submitted = 0  # loads handed to the thread (tests: the async path was taken)
        self.completed = 0
        self.failed = 0
        self._start()

    def _submitted(self, transfers: list[ChunkTransfer]) -> None:
        self._inflight += len(transfers)
        self.submitted += len(transfers)

    def _handle(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        try:
            # vLLM's tensors (and the pool's views made under them) are inference
            # tensors: writing them from this thread needs inference mode too.
            with torch.inference_mode():
                errors = self._load(t, meta)
        except Exception as err:  # never lose the thread: every block of the load is recomputed
            log.warning("request %s: background load failed: %s: %s", t.req_id, type(err).__name__, err)
            errors = set(t.block_ids[t.write_from // self._block_size : -(-t.chunk_ends[-1] // self._block_size)])
        with self._lock:
            self._done.add(t.req_id)
            self._errors |= errors
            self.completed += 1
            self.failed += bool(errors)
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    def take(self) -> tuple[set[str], set[int]]:
        """(requests whose loads finished, blocks that failed to load) since the last
        call: a request's failed blocks always come with its completion."""
        with self._lock:
            done, errors = self._done, self._errors
            self._done, self._errors = set(), set()
        return done, errors

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every submitted load to finish: whether
        none is left in flight."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout)

    def drain(self) -> None:
        """Wait until every submitted load is done (tests, shutdown)."""
        self._join()
