"""Deadlines and a health gate around the Mooncake client, whose calls can block for
seconds (a dead master costs each call its RPC connect retries) and cannot be
cancelled.

Every call runs on one of ``max_inflight`` worker threads and the caller waits at
most the deadline. A call that overruns keeps its worker until the client returns,
but the caller has its miss and the gate closes: for ``cooldown_s`` every call is a
miss without touching the client, then one call probes and its outcome reopens or
recloses the gate. When all workers are busy a call is a miss at once instead of
queueing, so neither time nor memory grows while the store is away.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Generic, TypeVar

from lmcache_core.health import HealthGate

T = TypeVar("T")


class StoreUnavailable(Exception):
    """The store could not be asked (gate closed, workers busy) or did not answer in time."""

    def __init__(self, message: str, *, overrun: bool = False) -> None:
        super().__init__(message)
        self.overrun = overrun


class Deadline:
    """Runs client calls on worker threads with a deadline each (see module docstring)."""

    def __init__(self, workers: int, gate: HealthGate) -> None:
        self.gate = gate
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="lmcache-mooncake")
        self._lock = threading.Lock()
        self._busy = 0
        self.overruns = 0
        self.rejected_busy = 0

    @property
    def busy(self) -> int:
        with self._lock:
            return self._busy

    def run(self, op: str, timeout_s: float, fn: Callable[[], T], *, on_late: Callable[[], None] | None = None) -> T:
        """``fn()``'s result, or :class:`StoreUnavailable` when the gate is closed, every
        worker is busy, or ``fn`` overran ``timeout_s`` (then ``on_late`` runs on the
        worker once ``fn`` finally returns, to release what the call was using)."""
        return self.start(op, timeout_s, fn, on_late=on_late).wait()

    def start(self, op: str, timeout_s: float, fn: Callable[[], T], *, on_late: Callable[[], None] | None = None) -> "Pending[T]":
        """Like :meth:`run`, but returns at once; :meth:`Pending.wait` gives the result.
        The deadline counts from now, so the caller can work while the call runs."""
        if not self.gate.allow():
            raise StoreUnavailable(f"{op}: store marked down, retrying after the cooldown")
        with self._lock:
            full = self._busy >= self._workers
            if full:
                self.rejected_busy += 1
            else:
                self._busy += 1
        if full:
            if self.gate.down:  # this call was the probe: keep the gate closed for another cooldown
                self.gate.failed()
            raise StoreUnavailable(f"{op}: all {self._workers} store workers are busy")
        pending: Pending[T] = Pending(self, op, timeout_s, on_late)
        pending.future = self._pool.submit(pending.call, fn)
        return pending

    def _done(self) -> None:
        with self._lock:
            self._busy -= 1

    def _overran(self) -> None:
        with self._lock:
            self.overruns += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Pending(Generic[T]):
    """One client call running on a worker, with its deadline."""

    def __init__(self, owner: Deadline, op: str, timeout_s: float, on_late: Callable[[], None] | None) -> None:
        self.owner = owner
        self.op = op
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.on_late = on_late
        self.future: Future[T] | None = None
        self._lock = threading.Lock()
        self._finished = False
        self._abandoned = False

    def call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            self.owner._done()
            with self._lock:
                self._finished = True
                late = self._abandoned
            if late and self.on_late is not None:
                self.on_late()

    def wait(self) -> T:
        """The call's result, or :class:`StoreUnavailable` (``overrun``) at the deadline."""
        assert self.future is not None
        try:
            return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except FutureTimeout:
            with self._lock:
                self._abandoned = not self._finished
            if not self._abandoned:
                return self.future.result()  # it returned just now; its result is a moment away
            self.owner._overran()
            raise StoreUnavailable(f"{self.op}: no answer within {self.timeout_s:.1f}s", overrun=True) from None
