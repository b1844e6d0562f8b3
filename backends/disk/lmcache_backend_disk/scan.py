"""The start-up scan: rebuild the index from the directory and clean what a crash
or a stray copy left behind.

Per shard directory (in parallel, ``io_threads``): chunk files become index entries
``(key, size, mtime_ns)``; with ``verify`` each file's header must match its name and
size, else it is removed; temp files whose writer is gone (or that are older than
:data:`STALE_TEMP_S`) are removed, while those of a live writer in another process
are left alone; files that are not ours inside a shard are removed.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_core.keys import ChunkKey
from lmcache_core.serde import FrameError

from .frames import check_frame_file
from .layout import FANOUT, TMP_PREFIX, parse_chunk_name, pid_alive, temp_owner_pid

log = logging.getLogger(__name__)

STALE_TEMP_S = 3600.0


@dataclass
class ScanResult:
    entries: list[tuple[ChunkKey, int, int]] = field(default_factory=list)
    stale_temps: int = 0
    bad_removed: int = 0
    foreign_removed: int = 0

    def merge(self, other: "ScanResult") -> None:
        self.entries.extend(other.entries)
        self.stale_temps += other.stale_temps
        self.bad_removed += other.bad_removed
        self.foreign_removed += other.foreign_removed


def _unlink(path: str, why: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as err:
        log.warning("disk tier: cannot remove %s (%s): %s", path, why, err)
        return False
    log.warning("disk tier: removed %s: %s", path, why)
    return True


def _scan_shard(shard_dir: str, shard: str, verify: bool, now: float) -> ScanResult:
    res = ScanResult()
    try:
        it = os.scandir(shard_dir)
    except (FileNotFoundError, NotADirectoryError):
        return res
    me = os.getpid()
    with it:
        for entry in it:
            name = entry.name
            path = entry.path
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if name.startswith(TMP_PREFIX):
                pid = temp_owner_pid(name)
                young = now - st.st_mtime < STALE_TEMP_S
                if pid is not None and young and pid != me and pid_alive(pid):
                    continue
                if _unlink(path, "unfinished write left by a process that is gone"):
                    res.stale_temps += 1
                continue
            key = parse_chunk_name(shard, name)
            if key is None:
                if _unlink(path, "not a chunk file of this tier"):
                    res.foreign_removed += 1
                continue
            if verify:
                try:
                    check_frame_file(path, st.st_size, name)
                except (FrameError, OSError) as err:
                    if _unlink(path, f"not a valid frame ({err})"):
                        res.bad_removed += 1
                    continue
            res.entries.append((key, st.st_size, st.st_mtime_ns))
    return res


def scan(root: Path, *, verify: bool, pool: Executor | None) -> ScanResult:
    """Scan every shard of ``root`` (on ``pool``'s threads, if given); see the
    module docstring."""
    now = time.time()
    total = ScanResult()
    base = str(root)
    work = lambda s: _scan_shard(os.path.join(base, s), s, verify, now)  # noqa: E731
    for part in (pool.map(work, FANOUT) if pool is not None else map(work, FANOUT)):
        total.merge(part)
    return total
