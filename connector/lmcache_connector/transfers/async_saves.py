"""Saves off the forward path (``connector.async_saves: true``), on vLLM's asynchronous save
contract.

``wait_for_save`` hands the step's saves (dense models) to one background thread and
returns, so the gather out of vLLM's blocks into the CPU tier overlaps the next
steps. The blocks a save reads are never reused before it has read them:

* a finished request: the scheduler side's ``request_finished`` returns True
  (``delay_free_blocks``) for every request it planned a save for, and vLLM frees its
  blocks only once the workers report it in ``finished_sending``; :meth:`SaveQueue.finished`
  reports it when all its saves are done (stored, or failed: a lost save is a future
  miss, and the blocks still go back);
* a preempted request: vLLM frees its blocks at once, without ``request_finished``;
  the scheduler side then sets ``drain_saves`` in the step's metadata and the worker
  waits for the queue before the step writes anything (loads or forward);
* a running request: the blocks of computed chunks do not change any more.

A lookup whose prefix is still being saved waits for that save, up to
``LOOKUP_WAIT_S`` (:meth:`SaveQueue.wait_for_chunks`), so a request that follows
another with the same prefix hits instead of missing by a few milliseconds.

Both sides apply the same rule (a request is delayed iff a save was planned for it
and the workers had not reported all of its saves done), so ``finished_sending`` names
exactly the requests vLLM holds blocks for: the worker reports, every step, how many
of each request's save transfers are done (:meth:`SaveQueue.progress`, sent as
vLLM's worker metadata); a request that finishes after its saves were reported done
has its blocks freed at once (one step sooner, which admits the next request a step
sooner), and the scheduler names it in the next step's ``freed_early`` so the worker
never reports it in ``finished_sending`` (:meth:`SaveQueue.forget`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable, Sequence

from ..log import get_logger
from ..protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata
from .transfer_queue import TransferQueue

log = get_logger(__name__)

SaveFn = Callable[[ChunkTransfer, LMCacheConnectorMetadata], None]

LOOKUP_WAIT_S = 0.1  # longest a lookup waits for a queued save of its chunks (the scheduler waits with it)


class SaveQueue(TransferQueue):
    """One background thread running ``save(transfer, meta)`` in submission order.
    ``save`` must not raise for a failed save (it counts it and returns); an
    exception that escapes it is logged and the save counts as done."""

    thread_name = "lmcache-async-saves"

    def __init__(self, save: SaveFn, nice: int = 0, cores: frozenset[int] | None = None) -> None:
        super().__init__(nice, cores)
        self._save = save
        self._pending: Counter[str] = Counter()  # saves queued or running, per request
        self._seen: set[str] = set()  # requests with a save submitted (delayed by the scheduler)
        self._finishing: set[str] = set()  # finished in vLLM, saves maybe still pending
        self._chunks: Counter[bytes] = Counter()  # chunk hashes in queued or running saves
        self._done: Counter[str] = Counter()  # save transfers done, per request still known
        self._saved = threading.Condition(self._lock)
        self.reported = 0  # requests reported in finished_sending
        self.drains = 0  # drains asked for by a preemption
        self._start()

    def _submitted(self, transfers: list[ChunkTransfer]) -> None:
        for t in transfers:
            self._pending[t.req_id] += 1
            self._seen.add(t.req_id)
            self._chunks.update(t.hashes)

    def _handle(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        try:
            self._save(t, meta)
        except Exception as err:  # never lose the thread: the save is a future miss
            log.warning("request %s: background save failed: %s: %s", t.req_id, type(err).__name__, err)
        finally:
            with self._lock:
                self._pending[t.req_id] -= 1
                if self._pending[t.req_id] <= 0:
                    del self._pending[t.req_id]
                if t.req_id in self._seen:
                    self._done[t.req_id] += 1
                self._chunks.subtract(t.hashes)
                for h in t.hashes:
                    if self._chunks[h] <= 0:
                        del self._chunks[h]
                self._saved.notify_all()

    def settled(self, transfers: Sequence[ChunkTransfer]) -> None:
        """Saves that ended in the step, outside this queue (stored by the layer
        pipeline, or dropped while vLLM sleeps): counted done, so their requests are
        freed or reported in ``finished_sending`` as if they had been queued (the
        scheduler holds a finished request's blocks until all its planned saves are)."""
        with self._lock:
            for t in transfers:
                self._seen.add(t.req_id)
                self._done[t.req_id] += 1

    def wait_for_chunks(self, hashes: Sequence[bytes], timeout: float = LOOKUP_WAIT_S) -> bool:
        """Wait until no queued or running save holds any of ``hashes`` (a lookup of a
        prefix being saved), at most ``timeout`` seconds: True when none is left."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(h in self._chunks for h in hashes):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._saved.wait(left)
        return True

    def drain(self) -> None:
        """Wait until every submitted save is done (before blocks may be reused)."""
        self.drains += 1
        self._join()

    def progress(self) -> dict[str, int]:
        """Save transfers done per request not yet reported or forgotten (for the
        scheduler, which frees a finished request's blocks at once when all the
        saves it planned are done)."""
        with self._lock:
            return dict(self._done)

    def forget(self, req_ids: list[str]) -> None:
        """Requests the scheduler freed at once (all their saves were reported done):
        never report them in ``finished_sending``."""
        with self._lock:
            for r in req_ids:
                if r in self._pending:  # cannot happen: the scheduler saw every save done
                    log.warning("request %s: freed with a save still pending", r)
                self._seen.discard(r)
                self._finishing.discard(r)
                self._done.pop(r, None)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests to report in ``finished_sending``: finished in vLLM (this call's
        ``finished_req_ids`` or an earlier one's), saved through this queue, and with
        no save pending. Each is reported once."""
        with self._lock:
            self._finishing |= finished_req_ids & self._seen
            done = {r for r in self._finishing if r not in self._pending}
            self._finishing -= done
            self._seen -= done
            for r in done:
                self._done.pop(r, None)
            self.reported += len(done)
        return done
