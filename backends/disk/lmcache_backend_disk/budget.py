"""The byte budget of one tier directory, shared by every process that uses it.

Each process used to enforce ``max_size`` over the chunks it knew about, so N
processes sharing a directory could grow it to about N times the budget. Now the
directory's byte count lives in ``<path>/LMCACHE_DISK_TIER.usage`` and every change
to the directory's chunk and temp files happens while holding an exclusive ``flock``
on that file, together with the matching change of the count:

* reserve: before a frame is written, evict until ``count + size <= max_size``,
  then add ``size`` and create the temp file (its name carries the size);
* publish: rename the temp onto the chunk name, subtracting the size of a chunk
  file it replaces;
* unlink (eviction, removal, a corrupt file, a failed write): subtract the size
  of the file actually removed.

So the count is the size of the chunk files plus the frames being written, and
it never exceeds ``max_size`` after a reservation. A process that dies mid-write
leaves its reservation counted (the directory stays smaller, never larger) until a
recount.

The file (little endian, 8-byte fields)::

    0     total, ~total            the count and its complement (a damaged file is
                                   noticed and recounted, never trusted); all an
                                   older version of the tier reads and writes
    16    magic "LMCSHRD1"
    24    256 x (count, generation) per shard: the bytes of that shard's files, and
                                   a number bumped by every change of its files

Recounting a directory holding many names (other people's files: junk costs a
directory entry each) must not hold the lock for the whole listing, or every other
process's put waits (and fails after :data:`LOCK_TIMEOUT_S`). With the per-shard
table it does not: a shard is listed without the lock, between two short holds that
read its generation; if no change happened meanwhile the listing is exact and
replaces that shard's count (:meth:`DirBudget.set_shard`), else the shard is listed
again. The table is valid when the magic is there and the per-shard counts add up
to the total; a file written by an older version (16 bytes), or damaged, has no
valid table, and is then recounted once with the lock held for the whole listing
(:meth:`DirBudget.set_all`), which writes the table.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from .fileio import open_regular

_PAIR = struct.Struct("<QQ")
_MASK = (1 << 64) - 1
SHARDS = 256
_MAGIC = int.from_bytes(b"LMCSHRD1", "little")
_TABLE = struct.Struct(f"<Q{2 * SHARDS}Q")
_SIZE = _PAIR.size + _TABLE.size
LOCK_TIMEOUT_S = 10.0  # a process stopped while holding the lock must not hang the others


class DirBudget:
    """The shared count, with a lock that excludes other threads and processes."""

    def __init__(self, path: Path, *, timeout: float = LOCK_TIMEOUT_S) -> None:
        self.path = path
        self.timeout = timeout
        self._fd, _ = open_regular(str(path), dir_fd=None, flags=os.O_RDWR | os.O_CREAT)  # no link, no FIFO
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

    def _read(self) -> tuple[int | None, list[int] | None]:
        """The total (None when damaged) and the table (counts then generations,
        None when there is no valid one). An empty file is a new, empty directory."""
        assert self._held, "read the count only under locked()"
        raw = os.pread(self._fd, _SIZE, 0)
        if not raw:
            return 0, [0] * (2 * SHARDS)
        if len(raw) < _PAIR.size:
            return None, None
        total, check = _PAIR.unpack_from(raw)
        if total ^ check != _MASK:
            return None, None
        if len(raw) < _SIZE:
            return total, None
        magic, *table = _TABLE.unpack_from(raw, _PAIR.size)
        if magic != _MAGIC or sum(table[:SHARDS]) != total:
            return total, None
        return total, table

    def _write(self, total: int, table: list[int] | None) -> None:
        total = min(max(0, total), _MASK)  # a struct.error here would fail a start
        if table is None:
            os.pwrite(self._fd, _PAIR.pack(total, total ^ _MASK), 0)
        else:
            os.pwrite(self._fd, _PAIR.pack(total, total ^ _MASK) + _TABLE.pack(_MAGIC, *table), 0)
        self.last = total

    def value(self) -> int | None:
        """The count; 0 for a new (empty) file, None when the file is damaged (the
        caller recounts the directory and :meth:`set_all` s it)."""
        total, _ = self._read()
        if total is not None:
            self.last = total
        return total

    def add(self, delta: int, shard: int) -> int | None:
        """Add ``delta`` bytes of files in ``shard`` (0 for a change that moves no
        bytes, a rename) and bump the shard's generation; None (nothing written) when
        the count is damaged."""
        total, table = self._read()
        if total is None:
            return None
        if table is not None:
            delta = max(delta, -table[shard])  # never below zero, and the table keeps adding up
            table[shard] += delta
            table[SHARDS + shard] = (table[SHARDS + shard] + 1) & _MASK
        self._write(total + delta, table)
        return self.last

    def shard_state(self, shard: int) -> tuple[int, int] | None:
        """``(count, generation)`` of ``shard``; None when there is no valid table
        (the caller then recounts with :meth:`set_all`)."""
        total, table = self._read()
        if total is None or table is None:
            return None
        self.last = total
        return table[shard], table[SHARDS + shard]

    def set_shard(self, shard: int, nbytes: int, generation: int) -> bool:
        """Make ``nbytes`` (a listing of the shard's files made since its generation
        was ``generation``) the shard's count, if the generation is still the same:
        no change of its files happened since, so the listing is exact. False (nothing
        written) when it changed or there is no valid table."""
        total, table = self._read()
        if total is None or table is None or table[SHARDS + shard] != generation:
            return False
        nbytes = min(max(0, nbytes), _MASK)
        if total - table[shard] + nbytes > _MASK:
            return False
        total += nbytes - table[shard]
        table[shard] = nbytes
        self._write(total, table)
        return True

    def set_all(self, per_shard: Sequence[int]) -> None:
        """Set every shard's count from a listing made under the lock (and so exact);
        this writes a valid table. Every generation is bumped."""
        assert self._held, "change the count only under locked()"
        _, table = self._read()
        gens = table[SHARDS:] if table is not None else [0] * SHARDS
        counts = [min(max(0, n), _MASK) for n in per_shard]
        if sum(counts) > _MASK:  # absurd sizes: a total that fits, no table
            self._write(_MASK, None)
            return
        self._write(sum(counts), counts + [(g + 1) & _MASK for g in gens])

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
