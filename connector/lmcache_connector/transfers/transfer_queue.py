"""What the background load and save queues share: one daemon thread that runs the
step's chunk transfers in submission order, never dies of a transfer's exception,
and can be drained and closed."""

from __future__ import annotations

import queue
import threading

from lmcache_core.threads import enter_background

from ..protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata


class TransferQueue:
    """Subclasses define :meth:`_submitted` (book-keeping under ``_lock`` before the
    transfers are queued) and :meth:`_handle` (run one transfer on the thread; it
    must catch its own errors)."""

    thread_name = "lmcache-transfers"

    def __init__(self, nice: int = 0, cores: frozenset[int] | None = None) -> None:
        """``nice``: added to the thread's nice value (``background_nice``); ``cores``:
        where the thread runs (default: ``background_cores``)."""
        self._nice = nice
        self._cores = cores
        self._q: queue.Queue[tuple[ChunkTransfer, LMCacheConnectorMetadata] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def _start(self) -> None:
        """Start the thread (subclasses call it at the end of their ``__init__``)."""
        self._thread.start()

    def _submitted(self, transfers: list[ChunkTransfer]) -> None:
        raise NotImplementedError

    def _handle(self, t: ChunkTransfer, meta: LMCacheConnectorMetadata) -> None:
        raise NotImplementedError

    def submit(self, meta: LMCacheConnectorMetadata, transfers: list[ChunkTransfer]) -> None:
        with self._lock:
            self._submitted(transfers)
        for t in transfers:
            self._q.put((t, meta))

    def _run(self) -> None:
        enter_background(self._nice, self._cores)
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                self._handle(*item)
            finally:
                self._q.task_done()

    def _join(self) -> None:
        self._q.join()

    def close(self) -> None:
        """Finish the queued transfers, then stop the thread."""
        self._q.put(None)
        self._thread.join()
