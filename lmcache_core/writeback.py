"""Write-behind to the slower tiers: :class:`TierWriter`, one per tier below the
first. The engine writes tier 0 synchronously and hands each slower tier's copy to
its writer: a bounded queue (``write_queue_size``) drained by as many threads as the
tier declares in ``write_concurrency``, each taking what is queued in one
``put_many`` call (one round trip on a ``BATCHED`` tier). A full queue drops the
write (counted, ``lmcache_core:tier_dropped_total``) rather than blocking the caller:
the tiers are a cache."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

from . import metrics
from .keys import ChunkKey
from .memory import MemoryBuffer

#: chunks one background write hands a slower tier at most (``put_many``)
BATCH_WRITES = 16


class TierWriter:
    """Background write-through for one slower tier, with as many writer threads as
    the tier declares in ``write_concurrency`` (remote tiers overlap round trips)."""

    def __init__(
        self,
        name: str,
        concurrency: int,
        maxsize: int,
        counters: metrics.EngineCounters,
        write: Callable[[Sequence[tuple[ChunkKey, MemoryBuffer]]], None],
        on_thread_start: Callable[[], None] = lambda: None,
    ) -> None:
        """``write(batch)`` stores one batch in the tier (it owns the tier's error
        accounting and metrics: :meth:`lmcache_core.tiers.Tier.put_many`);
        ``on_thread_start`` runs first on each writer thread (its priority)."""
        self.name = name
        self.on_thread_start = on_thread_start
        self.counters = counters
        self.write = write
        self.q: queue.Queue[tuple[ChunkKey, MemoryBuffer] | None] = queue.Queue(maxsize=maxsize)
        self._pending = 0
        self._cv = threading.Condition()
        self._stopping = threading.Event()
        n = max(1, int(concurrency))
        self.threads = [threading.Thread(target=self._run, name=f"lmcache-write-{name}-{i}", daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def submit(self, key: ChunkKey, buf: MemoryBuffer) -> bool:
        buf.retain()
        with self._cv:
            self._pending += 1
        try:
            self.q.put_nowait((key, buf))
            return True
        except queue.Full:
            buf.release()
            self._done()
            self.counters.add(dropped_writes=1)
            metrics.labeled(metrics.TIER_DROPPED, self.name).inc()
            return False

    def _done(self) -> None:
        with self._cv:
            self._pending -= 1
            self._cv.notify_all()

    def _run(self) -> None:
        self.on_thread_start()
        while not self._stopping.is_set():
            try:
                item = self.q.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            batch = [item]
            # What else is queued goes in the same call (put_many: one round trip on a
            # BATCHED tier), up to BATCH_WRITES chunks; a stop marker is put back.
            while len(batch) < BATCH_WRITES:
                try:
                    more = self.q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.q.put(None)
                    break
                batch.append(more)
            self._write(batch)

    def _write(self, batch: list[tuple[ChunkKey, MemoryBuffer]]) -> None:
        try:
            self.write(batch)
        finally:
            for _, buf in batch:
                buf.release()
                self._done()

    def flush(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Drop queued writes (their buffers released) and end the threads; never
        blocks on a full queue."""
        self._stopping.set()
        while True:
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].release()
                self._done()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
