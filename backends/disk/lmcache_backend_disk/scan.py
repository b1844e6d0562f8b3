"""The start-up scan (run by the backend in a background thread while the tier
already serves; ``stop`` ends it between files, ``pace`` slows it): rebuild the
index from the directory and clean what a crash left behind; and :func:`scan` with
``clean=False``, the listing that gives the directory's byte count for the budget.

Per shard directory (in parallel, ``io_threads``): chunk files become index entries
``(key, size, mtime_ns)``; with ``verify`` each file's header must match its name and
size, else it is removed; temp files whose writer is gone (or that are older than
:data:`STALE_TEMP_S`) are removed, while those of a live writer in another process
are left alone.

Only files the tier names (chunk and temp names) are ever removed. Anything else
in a shard (a stray file, a symbolic link, a directory) is left alone and counted
as ``foreign_kept``; a shard that is a symbolic link is not entered at all
(``shards_refused``), so nothing outside the cache directory is read or deleted.
"""

from __future__ import annotations

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
from lmcache_core.serde import FrameError

from .frames import check_frame_file
from .directory import FANOUT, TMP_PREFIX, open_dir, parse_chunk_name, pid_alive, temp_owner_pid, temp_reserved_bytes

log = logging.getLogger(__name__)

STALE_TEMP_S = 3600.0
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
    reserved_bytes: int = 0  # frames being written by live processes (from temp names)
    counted_bytes: int = 0  # chunk file bytes of a count-only listing (no entries)

    def merge(self, other: "ScanResult") -> None:
        self.entries.extend(other.entries)
        self.stale_temps += other.stale_temps
        self.bad_removed += other.bad_removed
        self.foreign_kept += other.foreign_kept
        self.shards_refused += other.shards_refused
        self.reserved_bytes += other.reserved_bytes
        self.counted_bytes += other.counted_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.counted_bytes + sum(size for _, size, _ in self.entries)


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
    verify: bool,
    clean: bool,
    now: float,
    stop: threading.Event | None = None,
    pace: Callable[[], None] | None = None,
    since: float | None = None,
    keys: bool = True,
) -> ScanResult:
    res = ScanResult()
    where = os.path.join(root, shard)
    try:
        dfd = open_dir(shard, root_fd)
    except FileNotFoundError:
        return res
    except OSError as err:
        log.warning(
            "disk tier: %s is not a directory (a symbolic link?): %s; the tier never follows links inside its "
            "directory, so that shard is not used; replace it with an empty directory",
            where,
            err.strerror or err,
        )
        res.shards_refused += 1
        return res
    me = os.getpid()
    try:
        for entry in os.scandir(dfd):
            if stop is not None and stop.is_set():
                break
            if pace is not None:
                pace()
            name = entry.name
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                res.foreign_kept += 1  # a link, directory, device...: not ours, never touched
                continue
            if name.startswith(TMP_PREFIX) and (pid := temp_owner_pid(name)) is not None:
                young = now - st.st_mtime < STALE_TEMP_S
                # this process's own temps are live when written since it opened the tier
                # (older ones are a dead process's that had the same pid: containers reuse pids)
                mine_live = since is not None and st.st_mtime >= since
                if young and (pid != me or not clean or mine_live) and pid_alive(pid):
                    res.reserved_bytes += temp_reserved_bytes(name)
                    continue
                if clean and _unlink(name, dfd, where, "unfinished write left by a process that is gone"):
                    res.stale_temps += 1
                continue
            if not keys:  # a count: the same names as parse_chunk_name, without making keys
                if _CHUNK_NAME.fullmatch(name) is None or name[_SHARD_AT : _SHARD_AT + 2] != shard:
                    res.foreign_kept += 1
                else:
                    res.counted_bytes += st.st_size
                continue
            key = parse_chunk_name(shard, name)
            if key is None:
                res.foreign_kept += 1
                continue
            if verify:
                try:
                    check_frame_file(name, st.st_size, name, dir_fd=dfd)
                except (FrameError, OSError) as err:
                    if _unlink(name, dfd, where, f"not a valid frame ({err})"):
                        res.bad_removed += 1
                    continue
            res.entries.append((key, st.st_size, st.st_mtime_ns))
    finally:
        os.close(dfd)
    return res


def scan_shards(
    root_fd: int,
    root: str,
    *,
    verify: bool,
    clean: bool = True,
    pool: Executor | None,
    stop: threading.Event | None = None,
    pace: Callable[[], None] | None = None,
    since: float | None = None,
    keys: bool = True,
) -> Iterator[ScanResult]:
    """Scan the shards of the tier directory open as ``root_fd`` (on ``pool``'s
    threads, if given), yielding one result per shard in shard order; see the
    module docstring. ``stop`` ends the scan early (between files); ``pace`` is
    called before each file; temps of this process written since ``since`` (a
    ``time.time()``) are live. With ``clean=False`` nothing is removed. With
    ``keys=False`` no entries are made, only the chunk files' bytes counted
    (``counted_bytes``; no ``verify`` then)."""
    now = time.time()
    work = lambda s: _scan_shard(root_fd, root, s, verify and keys, clean, now, stop, pace, since, keys)  # noqa: E731
    return pool.map(work, FANOUT) if pool is not None else map(work, FANOUT)


def scan(
    root_fd: int,
    root: str,
    *,
    verify: bool,
    clean: bool = True,
    pool: Executor | None,
    stop: threading.Event | None = None,
    keys: bool = True,
) -> ScanResult:
    """All of :func:`scan_shards` in one result (a listing for the budget count
    with ``clean=False``; a count only with ``keys=False``); partial if ``stop``
    was set meanwhile."""
    total = ScanResult()
    for part in scan_shards(root_fd, root, verify=verify, clean=clean, pool=pool, stop=stop, keys=keys):
        total.merge(part)
    return total
