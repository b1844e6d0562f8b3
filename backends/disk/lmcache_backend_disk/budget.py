"""The byte budget of one tier directory, shared by every process that uses it.

Each process used to enforce ``max_size`` over the chunks it knew about, so N
processes sharing a directory could grow it to about N times the budget. Now the
directory's byte count lives in ``<path>/LMCACHE_DISK_TIER.usage`` (the count and
its bitwise complement, 8 bytes each, little endian, so a damaged file is noticed and
recounted rather than trusted) and every change to the directory's chunk and temp files happens while
holding an exclusive ``flock`` on that file, together with the matching change of
the count:

* reserve: before a frame is written, evict until ``count + size <= max_size``,
  then add ``size`` and create the temp file (its name carries the size);
* publish: rename the temp onto the chunk name, subtracting the size of a chunk
  file it replaces;
* unlink (eviction, removal, a corrupt file, a failed write): subtract the size
  of the file actually removed.

So the count is the size of the chunk files plus the frames being written, and
it never exceeds ``max_size`` after a reservation. A process that dies mid-write
leaves its reservation counted (the directory stays smaller, never larger); every
process recounts the directory under the lock at start-up.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_PAIR = struct.Struct("<QQ")
_MASK = (1 << 64) - 1
LOCK_TIMEOUT_S = 10.0  # a process stopped while holding the lock must not hang the others


class DirBudget:
    """The shared count, with a lock that excludes other threads and processes."""

    def __init__(self, path: Path, *, timeout: float = LOCK_TIMEOUT_S) -> None:
        self.path = path
        self.timeout = timeout
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._held = False
        self.last = 0  # the count as last seen, for stats (no syscall to read it)

    @contextmanager
    def locked(self, stop: threading.Event | None = None) -> Iterator["DirBudget"]:
        """Hold the lock (both against this process's other threads and against
        other processes); :class:`TimeoutError` after :attr:`timeout` seconds, or as
        soon as ``stop`` is set while waiting for another process."""
        deadline = time.monotonic() + self.timeout
        if not self._thread_lock.acquire(timeout=self.timeout):
            raise TimeoutError(f"{self.path}: another thread held the disk tier's budget lock for {self.timeout:.0f} s")
        try:
            self._flock(deadline, stop)
            self._held = True
            try:
                yield self
            finally:
                self._held = False
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _flock(self, deadline: float, stop: threading.Event | None = None) -> None:
        pause = 0.0005
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if stop is not None and stop.is_set():
                    raise TimeoutError(f"{self.path}: stopped while waiting for the disk tier's budget lock") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.path}: another process held the disk tier's budget lock for {self.timeout:.0f} s "
                        "(stopped or hung?)"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.01)

    def value(self) -> int | None:
        """The count; 0 for a new (empty) file, None when the file is damaged (the
        caller recounts the directory and :meth:`set` s it)."""
        assert self._held, "read the count only under locked()"
        raw = os.pread(self._fd, _PAIR.size, 0)
        if not raw:
            self.last = 0
            return 0
        if len(raw) != _PAIR.size:
            return None
        count, check = _PAIR.unpack(raw)
        if count ^ check != _MASK:
            return None
        self.last = count
        return count

    def set(self, nbytes: int) -> None:
        assert self._held, "change the count only under locked()"
        self.last = max(0, nbytes)
        os.pwrite(self._fd, _PAIR.pack(self.last, self.last ^ _MASK), 0)

    def add(self, delta: int) -> int | None:
        """Add ``delta``; None (nothing written) when the count is damaged."""
        count = self.value()
        if count is None:
            return None
        self.set(count + delta)
        return self.last

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
