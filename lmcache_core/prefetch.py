"""Prefetches: a hit's chunks read from a slower tier into the memory tier in the
background, started at lookup, before vLLM schedules the load.

Each prefetch belongs to the request that looked it up (its pin id) and lives no
longer than that request's interest in it:

- :meth:`Prefetcher.cancel` (the engine calls it when the request's pins are released:
  finished, aborted, preempted, load failed) drops its queued prefetches and stops a
  running one once the window it is reading is read (a prefetch reads its run as a
  load does, :func:`~lmcache_core.fetch.fetch_run`: a window of at most
  ``WINDOW_BYTES``, 64 MiB, in one batched read per tier, so a stop cannot cut one);
- a load of the same run (:meth:`Prefetcher.await_run`) waits only for a prefetch that
  is already reading; one still queued (behind other requests' prefetches) is
  cancelled and the load reads the chunks itself, so a load never waits behind
  another request's prefetch;
- at most ``budget`` bytes are in flight (the engine bounds it by its pool);
- :meth:`Prefetcher.close` cancels everything queued, stops what runs after its
  current window and waits for it at most a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Callable, Iterator

log = logging.getLogger(__name__)

#: reads the run and yields once per chunk read (a chance to stop)
Reader = Callable[[], Iterator[object]]


@dataclass
class _Job:
    owner: str | None
    nbytes: int
    key: bytes
    stop: threading.Event = field(default_factory=threading.Event)
    future: Future[None] | None = None


class Prefetcher:
    """Background reads of hit runs, keyed by their first chunk's hash (see the module
    docstring). Thread-safe."""

    def __init__(self, budget: int, wait_s: float, initializer: Callable[[], None] | None = None) -> None:
        self.budget = budget
        self.wait_s = wait_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-prefetch", initializer=initializer)
        self._lock = threading.Lock()
        self._jobs: dict[bytes, _Job] = {}
        self._bytes = 0
        self._closed = False
        self.cancelled = 0  # prefetches dropped before they finished (cancel, a load, close)

    @property
    def bytes_in_flight(self) -> int:
        return self._bytes

    def start(self, key: bytes, nbytes: int, read: Reader, owner: str | None = None) -> bool:
        """Queue ``read`` (a run of ``nbytes`` whose first chunk hashes to ``key``) for
        ``owner``. False when nothing was started: closed, the same run already queued
        or reading, or the budget taken."""
        with self._lock:
            if self._closed or key in self._jobs or self._bytes + nbytes > self.budget:
                return False
            job = _Job(owner, nbytes, key)
            self._bytes += nbytes
            self._jobs[key] = job
            job.future = self._pool.submit(self._run, job, read)
        return True

    def _run(self, job: _Job, read: Reader) -> None:
        try:
            if not job.stop.is_set():
                for _ in read():
                    if job.stop.is_set():
                        break
        except Exception as err:  # a prefetch that fails is a load that reads later
            log.debug("prefetch failed: %s: %s", type(err).__name__, err)
        finally:
            self._forget(job)

    def _forget(self, job: _Job) -> None:
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
                self._bytes -= job.nbytes
                if job.stop.is_set():
                    self.cancelled += 1

    def _drop(self, job: _Job) -> None:
        """Stop ``job``: dequeued if it has not started (forgotten here, as its run
        never will), else it stops after the window it is reading."""
        job.stop.set()
        if job.future is not None and job.future.cancel():
            self._forget(job)

    def cancel(self, owner: str) -> int:
        """Stop every prefetch ``owner`` started; how many."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.owner == owner]
        for job in jobs:
            self._drop(job)
        return len(jobs)

    def await_run(self, key: bytes) -> None:
        """Before a load of the run starting at ``key``: wait (at most ``wait_s``) for
        its prefetch if it is reading; cancel it if it is still queued."""
        with self._lock:
            job = self._jobs.get(key)
        if job is None or job.future is None:
            return
        if job.future.cancel():  # still queued: the load reads it now instead
            job.stop.set()
            self._forget(job)
            return
        try:
            job.future.result(timeout=self.wait_s)
        except Exception:  # slow or failed: the load reads what is missing itself
            pass

    def close(self, deadline_s: float) -> bool:
        """Cancel queued prefetches, stop running ones after their window and wait
        for them at most ``deadline_s``; True when none is left running."""
        t0 = time.monotonic()
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        for job in jobs:
            self._drop(job)
        running = [j.future for j in jobs if j.future is not None and not j.future.cancelled()]
        done, left = wait_futures(running, timeout=max(0.0, deadline_s - (time.monotonic() - t0)))
        self._pool.shutdown(wait=False, cancel_futures=True)
        if left:
            log.warning("close: %d prefetch(es) still reading after %.1f s; not waiting for them", len(left), deadline_s)
        return not left
