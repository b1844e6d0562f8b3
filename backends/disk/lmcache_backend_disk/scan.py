"""The start-up scan (run by the backend in a background thread while the tier
already serves; ``stop`` ends it between files, ``pace`` slows it): rebuild the
index from the directory and clean what a crash left behind; and :func:`scan` /
:func:`scan_shard` with ``clean=False``, the listings that give the directory's
byte count for the budget.

Per shard directory (in parallel, ``io_threads``): chunk files become index entries
``(key, size, mtime_ns)``; with ``verify`` each file's header must match its name and
size, else it is removed; temp files count as writes in progress only as
:class:`~.owners.TempJudge` decides (a live writer of this tier, a sane size and
mtime), and the others are removed.

Names are classified before anything else is done with them: a name that is neither
a chunk name of the shard nor in the temp namespace (junk, other people's files)
costs its directory entry and nothing more (no ``stat``, no pacing), and is left
alone and counted as ``foreign_kept``. Under a tier name, a symbolic link or a
non-empty directory is left alone too (``foreign_kept``), and a FIFO, socket, device
node or empty directory is removed (``not_regular``, through the backend's
``drop_odd``, which re-checks it under the budget lock): it is never opened for
reading, which would block. A shard that is a symbolic link is not entered at all
(``shards_refused``), so nothing outside the cache directory is read or deleted.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Iterator

from lmcache_core.keys import KEY_FORMAT_VERSION, ChunkKey
from lmcache_core.frames import FrameError

from .directory import FANOUT, is_temp_name, open_dir, parse_chunk_name
from .fileio import NotRegularFile
from .frames import check_frame_file
from .owners import TempJudge

log = logging.getLogger(__name__)

# exactly the names ChunkKey.parse accepts (lowercase hex, 16 + 16 bytes); the
# shard is the chunk hash's first byte (the two characters at _SHARD_AT)
_CHUNK_NAME = re.compile(rf"v{KEY_FORMAT_VERSION}-[0-9a-f]{{32}}-[0-9a-f]{{32}}")
_SHARD_AT = len(f"v{KEY_FORMAT_VERSION}-") + 33


@dataclass
class ScanResult:
    entries: list[tuple[ChunkKey, int, int]] = field(default_factory=list)
    stale_temps: int = 0
    bad_removed: int = 0
    foreign_kept: int = 0
    shards_refused: int = 0
    not_regular: int = 0  # FIFOs, sockets, device nodes, empty directories under tier names: removed
    reserved_bytes: int = 0  # frames being written by live processes (from temp names)
    counted_bytes: int = 0  # chunk file bytes of a count-only listing (no entries)

    def merge(self, other: "ScanResult") -> None:
        self.entries.extend(other.entries)
        self.stale_temps += other.stale_temps
        self.bad_removed += other.bad_removed
        self.foreign_kept += other.foreign_kept
        self.shards_refused += other.shards_refused
        self.not_regular += other.not_regular
        self.reserved_bytes += other.reserved_bytes
        self.counted_bytes += other.counted_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.counted_bytes + sum(size for _, size, _ in self.entries)

    @property
    def budget_bytes(self) -> int:
        """What the listing puts in the shared count: chunk files and writes in progress."""
        return self.chunk_bytes + self.reserved_bytes


_NO_OWNERS = TempJudge(None, (1 << 64) - 1)  # only this process's own writes in progress are live

DropOdd = Callable[[int, str, os.stat_result], bool]
"""``drop_odd(dir_fd, name, st)``: remove the non-regular entry ``name`` if it still is
the inode ``st`` describes; True when it was removed."""


def _unlink(name: str, dir_fd: int, where: str, why: str) -> bool:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as err:
        log.warning("disk tier: cannot remove %s/%s (%s): %s", where, name, why, err)
        return False
    log.warning("disk tier: removed %s/%s: %s", where, name, why)
    return True


class Pacer:
    """At most ``rate`` calls of :meth:`wait` per second, shared by threads (0: no
    limit). Paces the background start-up scan so it leaves the disk and the CPU
    to serving."""

    def __init__(self, rate: float, stop: threading.Event | None = None) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.stop = stop
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now - 1.0) + self.interval  # a burst of at most one second
            delay = self._next - now
        if delay > 0:
            if self.stop is not None:
                self.stop.wait(delay)
            else:
                time.sleep(delay)


def _scan_shard(
    root_fd: int,
    root: str,
    shard: str,
    *,
    verify: bool,
    clean: bool,
    now: float,
    judge: TempJudge,
    stop: threading.Event | None = None,
    pace: Callable[[], None] | None = None,
    keys: bool = True,
    drop_odd: DropOdd | None = None,
) -> ScanResult:
    res = ScanResult()
    where = os.path.join(root, shard)
    dfd = _open_shard(root_fd, shard, where, res)
    if dfd is None:
        return res
    try:
        with os.scandir(dfd) as it:
            for entry in it:
                if stop is not None and stop.is_set():
                    break
                name = entry.name
                temp = is_temp_name(name)
                if not temp and (_CHUNK_NAME.fullmatch(name) is None or name[_SHARD_AT : _SHARD_AT + 2] != shard):
                    res.foreign_kept += 1  # junk costs its directory entry only: no stat, no pace
                    continue
                if pace is not None:
                    pace()
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    _odd(res, dfd, name, st, drop_odd if clean else None)
                    continue
                if temp:
                    reserved = judge.reserved(name, st, now)
                    if reserved is not None:
                        res.reserved_bytes += reserved
                    elif clean and _unlink(name, dfd, where, "unfinished write left by a process that is gone"):
                        res.stale_temps += 1
                    continue
                if not keys:  # a count: the same names as parse_chunk_name, without making keys
                    res.counted_bytes += st.st_size
                    continue
                key = parse_chunk_name(shard, name)
                if key is None:
                    res.foreign_kept += 1
                    continue
                if verify and not _verified(res, dfd, name, st, where, clean, drop_odd if clean else None):
                    continue
                res.entries.append((key, st.st_size, st.st_mtime_ns))
    finally:
        os.close(dfd)
    return res


def _open_shard(root_fd: int, shard: str, where: str, res: ScanResult) -> int | None:
    """The shard directory, opened without following a link; None when it is
    missing or refused (counted in ``res``)."""
    try:
        return open_dir(shard, root_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning(
            "disk tier: %s is not a directory (a symbolic link?): %s; the tier never follows links inside its "
            "directory, so that shard is not used; replace it with an empty directory",
            where,
            err.strerror or err,
        )
        res.shards_refused += 1
        return None


def _odd(res: ScanResult, dfd: int, name: str, st: os.stat_result, drop_odd: DropOdd | None) -> None:
    """A tier name that is not a regular file: a link or a directory that holds
    something is kept; the rest goes, if ``drop_odd`` is given."""
    if stat.S_ISLNK(st.st_mode) or drop_odd is None or not drop_odd(dfd, name, st):
        res.foreign_kept += 1
    else:
        res.not_regular += 1


def _verified(
    res: ScanResult, dfd: int, name: str, st: os.stat_result, where: str, clean: bool, drop_odd: DropOdd | None
) -> bool:
    """Check the chunk file's header; an invalid file is removed (counted), a name
    that stopped being a regular file meanwhile is handled as one."""
    try:
        check_frame_file(name, st.st_size, name, dir_fd=dfd)
    except NotRegularFile as err:
        _odd(res, dfd, name, err.st, drop_odd)
        return False
    except FileNotFoundError:
        return False
    except OSError as err:
        if err.errno == errno.ELOOP:  # replaced by a link since its stat: never deleted
            res.foreign_kept += 1
        elif clean and _unlink(name, dfd, where, f"not a valid frame ({err})"):
            res.bad_removed += 1
        return False
    except FrameError as err:
        if clean and _unlink(name, dfd, where, f"not a valid frame ({err})"):
            res.bad_removed += 1
        return False
    return True


def scan_shard(
    root_fd: int,
    root: str,
    shard: str,
    *,
    judge: TempJudge,
    stop: threading.Event | None = None,
    keys: bool = True,
) -> ScanResult:
    """One shard's listing for the budget (nothing removed, no headers read)."""
    return _scan_shard(root_fd, root, shard, verify=False, clean=False, now=time.time(), judge=judge, stop=stop, keys=keys)


def scan_shards(
    root_fd: int,
    root: str,
    *,
    verify: bool,
    clean: bool = True,
    pool: Executor | None,
    judge: TempJudge | None = None,
    stop: threading.Event | None = None,
    pace: Callable[[], None] | None = None,
    keys: bool = True,
    drop_odd: DropOdd | None = None,
) -> Iterator[ScanResult]:
    """Scan the shards of the tier directory open as ``root_fd`` (on ``pool``'s
    threads, if given), yielding one result per shard in shard order; see the
    module docstring. ``judge`` decides which temps are writes in progress (none of
    another process without one); ``stop`` ends the scan early (between files);
    ``pace`` is called before each chunk or temp file. With ``clean=False`` nothing
    is removed. With ``keys=False`` no entries are made, only the chunk files' bytes
    counted (``counted_bytes``; no ``verify`` then)."""
    now = time.time()
    judge = judge if judge is not None else _NO_OWNERS

    def work(shard: str) -> ScanResult:
        return _scan_shard(
            root_fd,
            root,
            shard,
            verify=verify and keys,
            clean=clean,
            now=now,
            judge=judge,
            stop=stop,
            pace=pace,
            keys=keys,
            drop_odd=drop_odd,
        )

    return pool.map(work, FANOUT) if pool is not None else map(work, FANOUT)


def scan(
    root_fd: int,
    root: str,
    *,
    verify: bool,
    clean: bool = True,
    pool: Executor | None,
    judge: TempJudge | None = None,
    stop: threading.Event | None = None,
    keys: bool = True,
) -> ScanResult:
    """All of :func:`scan_shards` in one result (a listing for the budget count
    with ``clean=False``; a count only with ``keys=False``); partial if ``stop``
    was set meanwhile."""
    total = ScanResult()
    for part in scan_shards(root_fd, root, verify=verify, clean=clean, pool=pool, judge=judge, stop=stop, keys=keys):
        total.merge(part)
    return total
