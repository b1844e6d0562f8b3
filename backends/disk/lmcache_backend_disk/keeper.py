"""The disk tier's budget layer: the lock protocol that keeps ``max_size`` for the
whole directory, whatever the number of processes sharing it.

The byte count lives in ``LMCACHE_DISK_TIER.usage`` (budget.py: :class:`DirBudget`),
and every change of the files that changes it is made under the exclusive lock on
it, together with the count: :class:`BudgetKeeper` reserves room for a write
(evicting least recently used chunks, relisting the directory once when those it
knows do not free enough), publishes or drops the written temp file, removes chunks,
recounts the directory shard by shard without holding the lock for a listing, and
removes non-regular entries under chunk or temp names.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from concurrent.futures import Executor, ThreadPoolExecutor

from lmcache_core.keys import ChunkKey

from .access import ShardRefused
from .budget import DirBudget
from .catalog import Catalog
from .directory import FANOUT, shard_name, temp_name
from .owners import track, untrack
from .scan import ScanResult, scan_shard, scan_shards

log = logging.getLogger("lmcache_backend_disk.backend")

RECOUNT_TRIES = 5  # listings of a shard that keeps changing before its recount is left for later


class _NoTable(Exception):
    """The usage file has no valid per-shard table: recount with the lock held."""


class BudgetKeeper(Catalog):
    """Every change of the directory's files, under the shared budget's lock."""

    def _reserve(self, key: ChunkKey, dfd: int, size: int) -> str | None:
        """Make room for ``size`` bytes in the directory, count them, and create the
        temp file that will hold them (its name carries the size, so a recount by
        any process sees the reservation). None when the room cannot be made: when
        the chunks this process knows do not free enough, it learns the directory
        (:meth:`_learn_directory`, without the lock) and tries once more."""
        assert self._budget is not None
        seen = self._relists
        for attempt in range(2):
            with self._budget.locked() as budget:
                if self._evict_locked(budget, size):
                    temp = temp_name(size)
                    track(temp)  # live for this process's scans before the file exists
                    try:
                        fd = os.open(
                            temp,
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                            0o644,
                            dir_fd=dfd,
                        )
                    except BaseException:
                        untrack(temp)
                        raise
                    os.close(fd)
                    budget.add(size, key.chunk_hash[0])
                    self._set_dir_bytes(budget.last)
                    return temp
            if attempt or self._closed or self._root_fd is None:
                return None
            self._learn_directory(seen)
        return None

    def _learn_directory(self, seen: int) -> None:
        """Learn the other processes' chunks (this process's index only knows its own
        and those it has seen) and recount the budget, from a listing made without
        holding the budget lock (:meth:`_recount`). One thread lists at a time; a
        thread that waited for another's listing (``seen`` is out of date) uses it."""
        with self._relist_lock:
            if self._relists != seen:
                return
            try:
                listing = self._recount(keys=True)
            except TimeoutError as err:
                log.warning("disk tier: directory not relisted: %s", err)
                return
            finally:
                self._relists += 1
            self._load_listing(listing)

    def _evict_locked(self, budget: DirBudget, size: int) -> bool:
        """Under the budget lock: delete least recently used chunks this process
        knows (its own and those it has seen) until ``size`` more bytes fit under
        ``max_size``; False when they do not free enough. A damaged count is
        recounted first (:meth:`_recount_locked`)."""
        count = budget.value()
        if count is None:
            self._load_listing(self._recount_locked(budget, keys=True))
            count = budget.last
        while count + size > self.max_size:
            if self._closed:
                return False
            with self._lock:
                victims = self._pop_victims(count + size - self.max_size)
            if not victims:
                return False
            for key, _ in victims:
                if self._closed:  # a closed tier changes no file, not even its trim's
                    return False
                freed = self._unlink_chunk(key)
                if freed:
                    left = budget.add(-freed, key.chunk_hash[0])
                    with self._lock:
                        self._stats.evictions += 1
                    self.evicted(key)
                    if left is None:  # damaged meanwhile (by someone ignoring the lock)
                        self._load_listing(self._recount_locked(budget, keys=True))
                        left = budget.last
                    count = left
        self._set_dir_bytes(count)
        return True

    def _unlink_chunk(self, key: ChunkKey, ino: int | None = None) -> int:
        """Remove ``key``'s chunk file (only a regular file, and only inode ``ino``
        if given); the bytes freed, 0 if there was none. Call under the budget lock."""
        name = key.to_str()
        try:
            with self._shard(key) as dfd:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or (ino is not None and st.st_ino != ino):
                    return 0
                os.unlink(name, dir_fd=dfd)
                return st.st_size
        except FileNotFoundError:
            return 0
        except (OSError, ShardRefused) as err:
            log.warning("disk tier: cannot remove %s: %s", self.root / shard_name(key) / name, err)
            return 0

    def _publish(self, key: ChunkKey, dfd: int, temp: str, size: int) -> None:
        """Rename the complete temp file onto the chunk name (a chunk file it
        replaces leaves the count), then make the rename durable."""
        assert self._budget is not None
        name = key.to_str()
        with self._budget.locked() as budget:
            try:
                old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                replaced = old.st_size if stat.S_ISREG(old.st_mode) else 0
            except FileNotFoundError:
                replaced = 0
            os.rename(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            budget.add(-replaced, key.chunk_hash[0])  # also when 0: the rename is a change of the shard
            self._set_dir_bytes(budget.last)
        if self.cfg.fsync:
            os.fsync(dfd)

    def _unlink_temp(self, key: ChunkKey, dfd: int, temp: str, size: int) -> None:
        """Drop a failed write's temp file and its reservation. Without the lock (a
        hung process holds it) the file still goes; its bytes stay counted until the
        next start-up recount (the directory stays under budget, never over)."""
        assert self._budget is not None
        try:
            with self._budget.locked() as budget:
                _unlink_quiet(temp, dfd)
                budget.add(-size, key.chunk_hash[0])
                self._set_dir_bytes(budget.last)
        except TimeoutError as err:
            log.warning("disk tier: %s", err)
            _unlink_quiet(temp, dfd)

    def _unlink_counted(self, key: ChunkKey, ino: int | None = None) -> int:
        """:meth:`_unlink_chunk` with the freed bytes taken off the shared count."""
        if self._budget is None:
            return self._unlink_chunk(key, ino)
        try:
            with self._budget.locked() as budget:
                freed = self._unlink_chunk(key, ino)
                if freed:
                    budget.add(-freed, key.chunk_hash[0])
                self._set_dir_bytes(budget.last)
        except TimeoutError as err:  # left for a later eviction or start-up scan
            log.warning("disk tier: not removed now: %s", err)
            return 0
        return freed

    def _recount_and_trim(self) -> None:
        """Set the shared count to what the directory holds (chunk files plus frames
        live processes are writing), shard by shard (:meth:`_recount`: the lock is
        never held for a listing), then evict down to ``max_size`` under the lock.
        Corrects whatever a process that died mid-write left."""
        assert self._budget is not None and self._root_fd is not None
        try:
            with ThreadPoolExecutor(max_workers=self.cfg.io_threads, thread_name_prefix="lmcache-disk-scan") as pool:
                self._recount(keys=False, stop=self._scan_stop, pool=pool)  # a count: the index is built
            if self._scan_stop.is_set():
                return
            with self._budget.locked(self._scan_stop) as budget:
                self._evict_locked(budget, 0)
        except TimeoutError as err:  # the count stays as the other processes keep it
            log.warning("disk tier: start-up recount skipped: %s", err)

    def _recount(self, *, keys: bool, stop: threading.Event | None = None, pool: Executor | None = None) -> ScanResult:
        """Recount the shared budget from a listing of the directory (chunk keys
        made if ``keys``) and return the listing. Each shard is listed without the
        budget lock, between two short holds of it: the first notes the shard's
        generation, the second replaces the shard's count if the generation is
        unchanged (no file of the shard changed meanwhile: the listing is exact), else
        the shard is listed again, at most :data:`RECOUNT_TRIES` times (a shard still
        changing keeps its count, as the processes changing it keep it:
        ``recount_busy_shards``). So a directory full of junk names costs the listing
        time, but no other process waits for it. A usage file without a valid per-shard
        table (damaged, or from an older version) is recounted once with the lock
        held (:meth:`_recount_locked`). Raises TimeoutError if the lock is not had."""
        assert self._budget is not None and self._root_fd is not None
        budget, root_fd, root = self._budget, self._root_fd, str(self.root)

        def one(i: int) -> tuple[ScanResult, bool]:
            part = ScanResult()
            for _ in range(RECOUNT_TRIES):
                with budget.locked(stop) as b:
                    state = b.shard_state(i)
                if state is None:
                    raise _NoTable
                part = scan_shard(root_fd, root, FANOUT[i], judge=self._judge, stop=stop, keys=keys)
                if stop is not None and stop.is_set():  # a partial listing is no count
                    return part, True
                with budget.locked(stop) as b:
                    if b.set_shard(i, part.budget_bytes, state[1]):
                        self._set_dir_bytes(b.last)
                        return part, True
            return part, False

        total = ScanResult()
        busy = 0
        try:
            for part, counted in pool.map(one, range(len(FANOUT))) if pool is not None else map(one, range(len(FANOUT))):
                total.merge(part)
                busy += not counted
        except _NoTable:
            with budget.locked(stop) as b:
                return self._recount_locked(b, keys=keys, stop=stop)
        if busy:
            log.info("disk tier %s: %d busy shards keep their counts until a later recount", self.root, busy)
            with self._lock:
                self._extra["recount_busy_shards"] += busy
        return total

    def _recount_locked(self, budget: DirBudget, *, keys: bool, stop: threading.Event | None = None) -> ScanResult:
        """Under the budget lock: list the whole directory and make it the count,
        writing the per-shard table. Holds the lock for a listing (a stat per chunk or
        temp file, a directory entry per other name): only for a usage file that is
        damaged or from an older version."""
        assert self._root_fd is not None
        parts = list(
            scan_shards(
                self._root_fd, str(self.root), verify=False, clean=False, pool=None, judge=self._judge, stop=stop, keys=keys
            )
        )
        total = ScanResult()
        for part in parts:
            total.merge(part)
        if stop is None or not stop.is_set():
            budget.set_all([part.budget_bytes for part in parts])
            self._set_dir_bytes(budget.last)
        return total

    def _drop_odd(self, dfd: int, name: str, st: os.stat_result) -> bool:
        """Remove the non-regular entry ``name`` of the shard ``dfd`` (unlink; rmdir
        for an empty directory) if it still is the inode ``st`` describes; True when
        removed. Under the budget lock, so it cannot have become a chunk meanwhile (a
        publish renames only under the lock). A link, or a tier that is closed or
        read-only, is left alone."""
        budget = self._budget
        if budget is None or self._closed or stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode):
            return False
        try:
            with budget.locked(self._scan_stop):
                now = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or stat.S_IFMT(now.st_mode) != stat.S_IFMT(st.st_mode):
                    return False
                if stat.S_ISDIR(now.st_mode):
                    os.rmdir(name, dir_fd=dfd)
                else:
                    os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            return False
        except (OSError, TimeoutError) as err:
            log.warning("disk tier: %s under a chunk or temp name is not a regular file; not removed: %s", name, err)
            return False
        log.warning(
            "disk tier: removed %s: a %s under a chunk or temp name", name, _KINDS.get(stat.S_IFMT(st.st_mode), "special file")
        )
        return True


_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFDIR: "directory",
}


def _unlink_quiet(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
