"""A total deadline for every S3 operation, whatever the server does.

botocore bounds each socket read (``read_timeout``) and the number of attempts, but
not the sum: an endpoint that trickles a few bytes every half second never trips a
read timeout and can hold a request for minutes. Two mechanisms close that gap:

* :func:`run_bounded` runs the network part of an operation on a worker and waits for
  it at most until the deadline; the caller then gets :class:`DeadlineExceeded`
  (a ``TimeoutError``, so the tier counts it as the endpoint being unavailable). The
  worker never touches caller-owned memory: it returns fresh bytes or nothing.
* :class:`Watchdog` shuts down the socket under a response body that is still being
  read at the deadline, so the abandoned worker (and its pooled connection) is freed
  at once instead of when the server stops trickling.

A server that trickles the response *headers* cannot be cut this way (the socket is
inside urllib3 until the headers are parsed): the caller still returns on time, and
the worker ends at botocore's read timeout or when the server gives up.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import socket
import threading
import time
from concurrent.futures import Executor, TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """An S3 operation did not finish within ``op_deadline_s``."""


def run_bounded(pool: Executor, deadline: float, what: str, fn: Callable[..., T], /, *args: Any, **kw: Any) -> T:
    """``fn(*args, **kw)`` on ``pool``; its result, its exception, or
    :class:`DeadlineExceeded` once ``time.monotonic()`` passes ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"{what}: no time left before the deadline")
    fut = pool.submit(fn, *args, **kw)
    try:
        return fut.result(timeout=left)
    except FutureTimeout:
        fut.cancel()  # still queued behind stuck workers: never run it
        raise DeadlineExceeded(f"{what} did not finish within the operation deadline") from None


def socket_of(body: Any) -> socket.socket | None:
    """The socket under a botocore ``StreamingBody`` (urllib3 2.x), or None."""
    raw = getattr(body, "_raw_stream", None)
    conn = getattr(raw, "_connection", None) or getattr(raw, "connection", None)
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        return sock
    fp = getattr(getattr(raw, "_fp", None), "fp", None)
    sock = getattr(getattr(fp, "raw", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


class Watchdog:
    """One thread that runs callbacks at their deadlines unless disarmed first."""

    def __init__(self, name: str = "lmcache-s3-watchdog") -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._closed = False
        self.fired = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, deadline: float, callback: Callable[[], None]) -> int:
        with self._cv:
            token = next(self._ids)
            self._armed[token] = callback
            heapq.heappush(self._heap, (deadline, token))
            self._cv.notify()
        return token

    def disarm(self, token: int) -> None:
        with self._cv:
            self._armed.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed:
                    while self._heap and self._heap[0][1] not in self._armed:
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._closed:
                    return
                _, token = heapq.heappop(self._heap)
                callback = self._armed.pop(token)
                self.fired += 1
            try:
                callback()
            except Exception as err:  # a dead socket: nothing more to cut
                log.debug("s3 watchdog callback: %s", err)

    @contextmanager
    def guard_body(self, body: Any, deadline: float) -> Iterator[None]:
        """While inside, a read of ``body`` still running at ``deadline`` fails at once."""
        sock = socket_of(body)
        if sock is None:
            yield
            return

        cut_done = threading.Event()

        def cut() -> None:
            cut_done.set()
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        token = self.arm(deadline, cut)
        try:
            yield
        except Exception:
            if cut_done.is_set():  # the read broke because we cut it: say why
                raise DeadlineExceeded("response body still arriving at the operation deadline") from None
            raise
        finally:
            self.disarm(token)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._armed.clear()
            self._cv.notify()
