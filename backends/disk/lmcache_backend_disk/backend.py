"""The ``disk`` tier: one serde frame per chunk file, durable, shared by the
processes of one machine, LRU within a byte budget that holds across restarts.

Contract details (beyond :class:`lmcache_core.backend.StorageBackend`):

* A chunk becomes visible only as a complete, fsynced file (temp file + rename), so
  a reader in any process sees the whole frame or nothing; two writers of one key
  each rename a complete frame of that key, and the last rename wins.
* The directory is the truth; the in-memory index (key -> size, LRU order) is a view
  of it. ``contains`` and ``put`` check the filesystem (one ``stat`` per key), so
  files written or evicted by another process are noticed; ``get`` opens the file
  whatever the index says and verifies every frame it reads (checksum, key).
* Start-up does not grow with the cache: the constructor returns at once and a
  background thread builds the index (:meth:`DiskBackend.wait_for_scan`). Chunks
  are served during the scan (``contains`` and ``get`` never needed the index),
  eviction during it takes the oldest chunks scanned so far, and the over-budget
  trim and the budget recount run after it, in the same thread.
* ``get`` refreshes the file's mtime; the start-up scan orders the index by mtime, so
  LRU order survives restarts.
* ``max_size`` holds for the directory, whatever the number of processes sharing
  it: a byte count shared through ``LMCACHE_DISK_TIER.usage`` and changed only
  under an exclusive lock on it, together with the files (see budget.py).
* Inside the directory no symbolic link is ever followed (shards are opened with
  ``O_NOFOLLOW``, files relative to them), and only files with the tier's own
  names are ever deleted.
* Hostile entries cost a miss, never a hang: every file is opened with
  ``O_NONBLOCK`` and must ``fstat`` as a regular file before a byte moves
  (fileio.py), so a FIFO, socket, device node or directory under a chunk name is a
  miss (``not_regular``) and is removed under the budget lock; a planted temp name
  reserves nothing unless a live process of this tier is writing it (owners.py);
  and junk names never make the lock be held for a listing (budget.py).
* Every failure is a miss or a skipped put, counted in :meth:`stats`: corrupt files
  are removed and never loaded; a full disk (ENOSPC) or a read-only directory makes
  ``put`` return False while reads go on.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import stat
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from lmcache_core.backend import BATCHED, PERSISTENT, SHARED, BackendContext, BackendStats, StorageBackend
from lmcache_core.config import ConfigError, validate_section
from lmcache_core.eviction import EvictionPolicy
from lmcache_core.keys import ChunkKey
from lmcache_core.plugins import get_plugin_manager
from lmcache_core.frames import Codec, FrameError, FrameHeader, FrameReader, FrameWriter, Verdict

from .budget import DirBudget
from .config import DiskConfig
from .directory import FANOUT, MARKER_TEXT, USAGE, TierDirectory, open_dir, shard_name, temp_name
from .fileio import NotRegularFile, open_regular, probe_o_direct, read_into_hasher, read_whole, write_atomic, write_parts
from .frames import read_frame_header
from .index import LruIndex, PolicyIndex
from .owners import Owners, TempJudge, track, untrack
from .scan import Pacer, ScanResult, scan_shard, scan_shards

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = FrameReader.MAX_FRAME_BYTES
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
PROGRESS_LOG_S = 10.0  # the background scan logs its progress this often
CLOSE_WAIT_S = 30.0  # close() waits this long for the background scan to stop
RECOUNT_TRIES = 5  # listings of a shard that keeps changing before its recount is left for later


class _NoTable(Exception):
    """The usage file has no valid per-shard table: recount with the lock held."""


class _ShardRefused(Exception):
    """The shard directory is a symbolic link or not a directory: never entered."""


class DiskBackend(StorageBackend):
    name = "disk"
    capabilities = frozenset({PERSISTENT, SHARED, BATCHED})

    def __init__(
        self,
        cfg: DiskConfig,
        *,
        codec: Codec,
        codecs: Mapping[str, Codec],
        key_path: str = "disk",
        source: str = "code",
        policy: Callable[[], EvictionPolicy] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        self._make_policy = policy
        self.cfg = cfg
        self.root = Path(cfg.path).expanduser()
        self.directory = TierDirectory(self.root)
        self.max_size = cfg.max_size
        self._codec = codec
        self._codecs = dict(codecs)
        self._seal = FrameWriter.seal_of(codec)
        self._lock = threading.Lock()
        self._index = self._new_index()
        self._last_put_error: str | None = None
        self._closed = False
        self._root_fd: int | None = None
        self._budget: DirBudget | None = None
        self._owners: Owners | None = None
        self._judge = TempJudge(None, cfg.max_size)
        self._relist_lock = threading.Lock()  # one listing to learn the directory at a time
        self._relists = 0
        self._refused_shards: set[str] = set()
        self._shards_checked: set[str] = set()  # shards contains() has seen to be directories (or refused)
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="lmcache-disk-io")
        # get_many: whole reads in parallel (each may use _pool for its parts)
        self._batch = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="lmcache-disk-batch")
        self._stats = BackendStats(self.name, bytes_capacity=self.max_size)
        self._extra: dict[str, Any] = {
            "path": str(self.root),
            "corrupt_removed": 0,
            "disk_full": 0,
            "write_errors": 0,
            "shape_mismatch": 0,
            "links_refused": 0,
            "not_regular": 0,
            "recount_busy_shards": 0,
            "dir_bytes": 0,
            "unavailable": None,
        }
        self._prepare_root(key_path, source)
        self._open_root()
        self._o_direct = False
        if cfg.o_direct and self._extra["unavailable"] is None:
            reason = probe_o_direct(self.root)
            self._o_direct = reason is None
            if reason:
                log.warning("disk tier %s: o_direct requested, using buffered I/O: %s", self.root, reason)
            self._extra["o_direct_fallback"] = reason
        self._extra["o_direct"] = self._o_direct
        # The background start-up scan (see _background_scan). Until its index is
        # complete, chunks it has listed wait in _found (key -> size) and in
        # _found_heap (mtime order: the eviction victims meanwhile); keys dropped
        # meanwhile are remembered so a listing that raced with the drop is ignored.
        self._indexing = self._root_fd is not None
        self._found: dict[ChunkKey, int] = {}
        self._found_bytes = 0
        self._found_heap: list[tuple[int, int, ChunkKey]] = []
        self._dropped: set[ChunkKey] = set()
        self._scan_stop = threading.Event()
        self._scan_done = threading.Event()
        self._extra.update(
            startup_stale_temps=0,
            startup_bad_removed=0,
            startup_foreign_kept=0,
            startup_shards_refused=0,
            startup_not_regular=0,
            scan_state="indexing" if self._indexing else "skipped",
            scan_shards_done=0,
            scan_files=0,
            scan_index_s=None,
            scan_s=None,
        )
        self._scan_thread: threading.Thread | None = None
        self._scan_running = self._indexing  # under self._lock: the thread has not finished
        self._close_deferred = False  # under self._lock: close() left the directory to the thread
        if self._indexing:
            self._scan_thread = threading.Thread(target=self._background_scan, name="lmcache-disk-scan", daemon=True)
            self._scan_thread.start()
        else:
            self._scan_done.set()
        self._extra["startup_s"] = round(time.perf_counter() - t0, 4)

    # -- set-up -------------------------------------------------------------------------
    def _prepare_root(self, key_path: str, source: str) -> None:
        """Create the directory and its marker. A path that is clearly wrong (a file,
        or a non-empty directory that is not a tier) is a config error; a directory we
        cannot write (read-only, permissions) leaves a read-only tier, since reads of
        a pre-filled shared cache may still work."""
        root = self.root
        where = f"{key_path}.path"
        if root.exists() and not root.is_dir():
            raise ConfigError(f"{where}: {root} exists and is not a directory (from {source})")
        if root.is_dir() and not self.directory.marker.exists():
            try:
                extra = [p.name for p in root.iterdir()][:3]
            except OSError as err:
                raise ConfigError(f"{where}: cannot list {root}: {err.strerror} (from {source})") from None
            if extra:
                raise ConfigError(
                    f"{where}: {root} is not empty and is not a disk tier (no {self.directory.marker.name} "
                    f"file; found e.g. {extra}); use an empty or new directory (from {source})"
                )
        try:
            root.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.directory.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(MARKER_TEXT)
            except FileExistsError:
                pass
            for shard in FANOUT:
                try:
                    os.mkdir(root / shard, 0o755)
                except FileExistsError:  # a directory, or something refused when used (a link)
                    pass
        except OSError as err:
            reason = f"cannot write {root}: {err.strerror or err}"
            self._extra["unavailable"] = reason
            log.warning("disk tier: %s; puts will be skipped, reads go on", reason)

    def _open_root(self) -> None:
        """Hold the directory open (every file operation is relative to it) and the
        shared budget. Neither is possible for a directory we cannot write: the tier
        then serves reads only (as far as it can open the directory)."""
        try:
            self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            self._extra["unavailable"] = self._extra["unavailable"] or f"cannot open {self.root}: {err.strerror or err}"
            return
        try:
            budget = DirBudget(self.root / USAGE)
        except OSError as err:
            reason = f"cannot open {self.root / USAGE}: {err.strerror or err}"
            self._extra["unavailable"] = self._extra["unavailable"] or reason
            log.warning("disk tier: %s; puts will be skipped, reads go on", reason)
            return
        try:  # without it the other processes would take this one's writes for leftovers
            self._owners = Owners(self._root_fd)
        except OSError as err:
            budget.close()
            reason = f"cannot lock {self.root}/{err.filename or 'LMCACHE_DISK_TIER.owners'}: {err.strerror or err}"
            self._extra["unavailable"] = self._extra["unavailable"] or reason
            log.warning("disk tier: %s; puts will be skipped, reads go on", reason)
            return
        self._budget = budget
        self._judge = TempJudge(self._owners, self.max_size)

    # -- the background start-up scan ------------------------------------------------------
    def _background_scan(self) -> None:
        """Index the directory shard by shard (on a pool of its own, paced by
        ``scan_rate``), serving meanwhile; then order the index by mtime, and recount
        and trim the directory under the budget lock. Killing the process at any
        point loses nothing: only the index is built, in memory."""
        assert self._root_fd is not None
        t0 = time.perf_counter()
        verify = self.cfg.verify_on_start
        log.info("disk tier %s: indexing the directory in the background (verify_on_start=%s)", self.root, verify)
        total = ScanResult()
        seq = 0
        next_log = time.monotonic() + PROGRESS_LOG_S
        state = "failed"
        try:
            with ThreadPoolExecutor(max_workers=self.cfg.io_threads, thread_name_prefix="lmcache-disk-scan") as pool:
                pace = Pacer(self.cfg.scan_rate, self._scan_stop).wait if self.cfg.scan_rate else None
                parts = scan_shards(
                    self._root_fd,
                    str(self.root),
                    verify=verify,
                    pool=pool,
                    judge=self._judge,
                    stop=self._scan_stop,
                    pace=pace,
                    drop_odd=self._drop_odd,
                )
                for part in parts:
                    with self._lock:
                        for key, size, mtime in part.entries:
                            if key in self._dropped or key in self._index:
                                continue
                            self._found_bytes += size - self._found.get(key, 0)
                            self._found[key] = size
                            heapq.heappush(self._found_heap, (mtime, seq, key))
                            seq += 1
                        self._extra["scan_shards_done"] += 1
                        self._extra["scan_files"] += len(part.entries)
                    part.entries = []
                    total.merge(part)
                    if time.monotonic() >= next_log:
                        next_log = time.monotonic() + PROGRESS_LOG_S
                        log.info(
                            "disk tier %s: background scan %d/256 shards, %d chunk files indexed",
                            self.root,
                            self._extra["scan_shards_done"],
                            self._extra["scan_files"],
                        )
            if self._scan_stop.is_set():
                state = "stopped"
                return
            self._merge_found()
            with self._lock:
                self._extra.update(
                    scan_state="trimming",
                    scan_index_s=round(time.perf_counter() - t0, 4),
                    startup_stale_temps=total.stale_temps,
                    startup_bad_removed=total.bad_removed,
                    startup_foreign_kept=total.foreign_kept,
                    startup_shards_refused=total.shards_refused,
                    startup_not_regular=total.not_regular,
                )
            if self._budget is not None:
                self._recount_and_trim()
            state = "stopped" if self._scan_stop.is_set() else "complete"
            log.info(
                "disk tier %s: index complete: %d chunk files in %.2f s (%d invalid removed, %d stale temps removed, "
                "%d foreign files kept, %d non-regular entries removed), %d evictions",
                self.root,
                self._extra["scan_files"],
                time.perf_counter() - t0,
                total.bad_removed,
                total.stale_temps,
                total.foreign_kept,
                total.not_regular,
                self._stats.evictions,
            )
        except Exception:
            log.exception("disk tier %s: background start-up scan failed; serving goes on from the files", self.root)
        finally:
            with self._lock:
                self._indexing = False
                self._found, self._found_heap, self._found_bytes = {}, [], 0
                self._dropped.clear()
                self._extra["scan_state"] = state
                self._extra["scan_s"] = round(time.perf_counter() - t0, 4)
                self._scan_running = False
                release = self._close_deferred
            self._scan_done.set()
            if release:  # close() gave up waiting for us: the directory is ours to close
                self._release_dir()

    def _new_index(self) -> LruIndex:
        """An empty index: LRU, or driven by the configured eviction policy."""
        return LruIndex() if self._make_policy is None else PolicyIndex(self._make_policy)

    def _merge_found(self) -> None:
        """Make the scanned chunks the least recently used part of the index, oldest
        mtime first, below the chunks this process used during the scan."""
        with self._lock:
            order = self._found_heap
            self._found_heap = []
        order.sort()
        with self._lock:
            merged = self._new_index()
            found, current = self._found, self._index
            for _, _, key in order:
                size = found.get(key)
                if size is not None and key not in current:
                    merged.add(key, size)
            for key, size in current.items():
                merged.add(key, size)
            self._index = merged
            self._found, self._found_bytes = {}, 0
            self._dropped = set()
            self._indexing = False

    def _forget(self, key: ChunkKey) -> None:
        """Drop ``key`` from the index (it is gone from the directory). Call under
        ``self._lock``."""
        self._index.discard(key)
        if self._indexing:
            self._found_bytes -= self._found.pop(key, 0)
            self._dropped.add(key)

    def _used(self, key: ChunkKey, size: int, *, fresh: bool = False) -> None:
        """``key`` (``size`` bytes on disk) was just read or written: most recently
        used. ``fresh``: a new file (its size may differ). Call under ``self._lock``."""
        if fresh or not self._index.touch(key):
            self._index.add(key, size)
        if self._found:
            self._found_bytes -= self._found.pop(key, 0)

    def _pop_victims(self, nbytes: int) -> list[tuple[ChunkKey, int]]:
        """Least recently used entries freeing ``nbytes``: during the scan the oldest
        chunks scanned so far come first (older than any this process used since it
        started). Call under ``self._lock``."""
        out: list[tuple[ChunkKey, int]] = []
        freed = 0
        heap = self._found_heap
        while freed < nbytes and heap:
            _, _, key = heapq.heappop(heap)
            size = self._found.pop(key, None)
            if size is None:
                continue
            self._found_bytes -= size
            if key in self._index:
                continue
            out.append((key, size))
            freed += size
        if freed < nbytes:
            out.extend(self._index.pop_lru(nbytes - freed))
        return out

    def wait_for_scan(self, timeout: float | None = None) -> bool:
        """Wait until the background start-up scan (index, recount, trim) is over;
        False on timeout."""
        return self._scan_done.wait(timeout)

    @property
    def index_complete(self) -> bool:
        return not self._indexing

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

    @contextmanager
    def _shard(self, key: ChunkKey, *, create: bool = False) -> Iterator[int]:
        """The key's shard directory as a descriptor, opened without following a
        link; raises :class:`_ShardRefused` for a link (logged once per shard) and
        FileNotFoundError for a missing shard (``create`` makes it)."""
        name = shard_name(key)
        if self._root_fd is None:
            raise FileNotFoundError(errno.ENOENT, "tier directory is not open")
        try:
            fd = open_dir(name, self._root_fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o755, dir_fd=self._root_fd)
            except FileExistsError:
                pass
            fd = self._open_shard_or_refuse(name)
        except OSError as err:
            self._refuse_shard(name, err)
            raise _ShardRefused(name) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_shard_or_refuse(self, name: str) -> int:
        try:
            return open_dir(name, self._root_fd)
        except OSError as err:
            self._refuse_shard(name, err)
            raise _ShardRefused(name) from None

    def _refuse_shard(self, name: str, err: OSError) -> None:
        with self._lock:
            self._extra["links_refused"] += 1
            first = name not in self._refused_shards
            self._refused_shards.add(name)
        if first:
            log.warning(
                "disk tier: %s is not a directory (a symbolic link?): %s; the tier never follows links inside "
                "its directory, so chunks of that shard are misses and are not stored; replace it with an "
                "empty directory",
                self.root / name,
                err.strerror or err,
            )

    # -- contract -----------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        """One ``stat`` per key (relative to the open directory, no path objects):
        a few microseconds, and files other processes wrote or deleted are seen."""
        rfd = self._root_fd
        if rfd is None:
            return 0
        refused, checked = self._refused_shards, self._shards_checked
        n = 0
        for key in keys:
            shard = key.chunk_hash[:1].hex()
            try:
                if shard not in checked:
                    self._check_shard(shard)
                if refused and shard in refused:
                    raise FileNotFoundError
                st = os.stat(f"{shard}/{key.to_str()}", dir_fd=rfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise FileNotFoundError
            except OSError:
                with self._lock:
                    self._forget(key)
                break
            if key not in self._index and key not in self._found:  # unlocked reads of dicts: atomic
                with self._lock:
                    if key not in self._index and key not in self._found:
                        self._index.add(key, st.st_size)
            n += 1
        return n

    def _check_shard(self, shard: str) -> None:
        """Before ``contains`` first stats through a shard (a path relative to the
        tier directory), make sure the shard is a directory and not a link; a link
        joins the refused shards (as when :meth:`_shard` meets it)."""
        try:
            fd = open_dir(shard, self._root_fd)
        except FileNotFoundError:
            return  # not there (yet): the stat below misses; checked again next time
        except OSError as err:
            self._refuse_shard(shard, err)
        else:
            os.close(fd)
        self._shards_checked.add(shard)

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        if self._closed:
            return False
        try:
            with self._shard(key, create=True) as dfd:
                return self._put_in(key, data, dfd)
        except _ShardRefused:
            with self._lock:
                self._stats.skipped += 1
            return False
        except OSError as err:
            return self._put_failed(err)

    def _put_in(self, key: ChunkKey, data: torch.Tensor, dfd: int) -> bool:
        name = key.to_str()
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):  # a link under a chunk name: not ours, kept
            with self._lock:
                self._extra["links_refused"] += 1
                self._stats.skipped += 1
            return False
        if st is not None and not stat.S_ISREG(st.st_mode):  # a FIFO, socket, device, directory
            with self._lock:
                self._extra["not_regular"] += 1
            if not self._drop_odd(dfd, name, st):
                with self._lock:
                    self._stats.skipped += 1
                return False
            st = None
        if st is not None:
            with self._lock:
                self._used(key, st.st_size)
            return True
        if self._budget is None:
            raise OSError(errno.EROFS, self._extra["unavailable"] or "the tier directory is not writable")
        frame = self._frame(key, data)
        size = frame.size
        with self._lock:
            self._forget(key)
        temp = self._reserve(key, dfd, size) if size <= self.max_size else None
        if temp is None:
            with self._lock:
                self._stats.skipped += 1
            return False
        try:
            self._write(dfd, temp, frame)
            self._publish(key, dfd, temp, size)
        except OSError as err:
            self._unlink_temp(key, dfd, temp, size)
            return self._put_failed(err)
        finally:
            untrack(temp)
        with self._lock:
            self._used(key, size, fresh=True)
            self._stats.puts += 1
            self._stats.put_bytes += data.nbytes
            self._last_put_error = None
        return True

    def _put_failed(self, err: OSError) -> bool:
        with self._lock:
            if err.errno in _FULL_ERRNOS:
                self._stats.skipped += 1
                self._extra["disk_full"] += 1
            else:
                self._stats.errors += 1
                self._extra["write_errors"] += 1
        why = f"{type(err).__name__}: {err.strerror or err}"
        if why != self._last_put_error:  # one line per kind of failure, not per chunk
            self._last_put_error = why
            log.warning("disk tier %s: puts are failing (%s); counted in stats, serving goes on", self.root, why)
        return False

    # -- the shared budget (see budget.py): every change of the files under its lock ------
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

    def _load_listing(self, listing: ScanResult) -> None:
        """Make a listing of the whole directory the index (oldest mtime first)."""
        with self._lock:
            self._index = self._new_index()
            self._index.load(listing.entries)
            self._found, self._found_heap, self._found_bytes = {}, [], 0  # all in the listing

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
        except (OSError, _ShardRefused) as err:
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

    def _frame(self, key: ChunkKey, data: torch.Tensor) -> FrameWriter:
        # raw for chunks the codec cannot take (fp8: byte pages); a tensor codec (fp8) gets the tensor
        return FrameWriter(key, data, self._codec, seal=self._seal)

    def _write(self, dfd: int, temp: str, frame: FrameWriter) -> None:
        if self._o_direct:
            write_atomic(temp, [frame.header(), frame.payload], dir_fd=dfd, fsync=self.cfg.fsync, o_direct=True)
        else:
            write_parts(
                temp,
                dir_fd=dfd,
                header_len=frame.header_len,
                payload=frame.payload,
                make_header=frame.header,
                fsync=self.cfg.fsync,
                pool=self._pool,
            )

    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Reads in parallel, ``io_threads`` at a time (parallel preads keep a fast
        device's queue full); a key that fails is a miss, the others unaffected."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output tensors")
        if len(keys) <= 1 or self.cfg.io_threads <= 1:
            return [self.get(k, o) for k, o in zip(keys, outs)]
        return list(self._batch.map(self.get, keys, outs))

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        if self._closed:
            return False
        try:
            with self._shard(key) as dfd:
                return self._get_in(key, out, dfd)
        except (FileNotFoundError, NotADirectoryError, _ShardRefused):
            return self._miss(key)

    def _get_in(self, key: ChunkKey, out: torch.Tensor, dfd: int) -> bool:
        path = self.directory.chunk_path(key)  # for messages; every operation is relative to dfd
        name = key.to_str()
        try:  # O_NONBLOCK, and a regular file or nothing: a FIFO here must not hang the engine
            fd, st = open_regular(name, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            return self._miss(key)
        except NotRegularFile as err:
            return self._not_regular(key, dfd, name, err.st)
        except OSError as err:
            if err.errno == errno.ELOOP:  # a symbolic link under a chunk name: never followed, never deleted
                with self._lock:
                    self._extra["links_refused"] += 1
                return self._miss(key)
            return self._read_error(path, err)
        try:
            try:
                info, _, offset = read_frame_header(fd, st.st_size)
            except FrameError as err:
                self._drop_corrupt(key, path, st.st_ino, str(err))
                return False
            try:
                FrameReader(self._codecs, seal=self._seal).check(info, key=key, out=out)
            except FrameError as err:
                if not err.keep_if_intact:  # corrupt, another key's, or sealed otherwise: not ours to serve
                    self._drop_corrupt(key, path, st.st_ino, str(err))
                    return False
                # A frame for this key that this caller cannot take. Keep the file only
                # if it is intact and sealed as we read: a flipped byte in the header
                # can fake another shape or a codec installed elsewhere.
                scratch = memoryview(np.empty(info.payload_len, dtype=np.uint8))
                if not self._read_verified(fd, offset, scratch, info, key, path, st.st_ino):
                    return False
                if err.verdict is Verdict.FOREIGN:
                    log.warning("disk tier: %s: %s", path, err)  # not installed here, or lossy and not this tier's
                else:
                    with self._lock:
                        self._extra["shape_mismatch"] += 1
                return self._miss(key, keep=True)
            direct = (
                info.codec == "raw"
                and info.payload_len == info.raw_len
                and not self._o_direct
                and out.device.type == "cpu"
                and out.is_contiguous()
            )
            if direct:
                dst = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
                if not self._read_verified(fd, offset, dst, info, key, path, st.st_ino):
                    return False
        except OSError as err:
            return self._read_error(path, err)
        finally:
            os.close(fd)
        if not direct:
            try:
                buf, ino = read_whole(name, dir_fd=dfd, o_direct=self._o_direct, max_bytes=MAX_FRAME_BYTES)
            except (FileNotFoundError, NotADirectoryError):
                return self._miss(key)
            except NotRegularFile as err:  # replaced since the first open
                return self._not_regular(key, dfd, name, err.st)
            except ValueError as err:
                self._drop_corrupt(key, path, None, str(err))
                return False
            except OSError as err:
                return self._read_error(path, err)
            _, reason = FrameReader(self._codecs).decode(buf, key=key, out=out)
            if reason is not None:
                self._drop_corrupt(key, path, ino, reason)
                return False
        try:
            os.utime(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            pass  # a read-only directory keeps its old LRU order
        with self._lock:
            self._used(key, st.st_size)
            self._stats.hits += 1
            self._stats.get_bytes += out.nbytes
        return True

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            self._forget(key)
        return self._unlink_counted(key) > 0

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

    def stats(self) -> BackendStats:
        with self._lock:
            s = self._stats.snapshot()
            s.extra = dict(self._extra)
            s.chunks = len(self._index) + len(self._found)
            s.bytes_used = self._index.bytes + self._found_bytes
        return s

    def _set_dir_bytes(self, count: int | None) -> None:
        with self._lock:
            self._extra["dir_bytes"] = count

    def close(self) -> None:
        """Stop the background scan and wait for it (it stops between files, and a
        trim between deletions), at most :data:`CLOSE_WAIT_S`: a thread stuck longer
        (a hung filesystem) is logged and closes the directory itself when it ends,
        so no descriptor it uses is ever closed or reused under it."""
        if self._closed:
            return
        self._closed = True
        self._scan_stop.set()
        if self._scan_thread is not None:
            self._scan_thread.join(CLOSE_WAIT_S)
        with self._lock:
            self._close_deferred = self._scan_running
        self._batch.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self._close_deferred:
            log.warning(
                "disk tier %s: the background scan did not stop within %.0f s of close(); "
                "it closes the directory when it ends and changes no file meanwhile",
                self.root,
                CLOSE_WAIT_S,
            )
            return
        self._release_dir()

    def _release_dir(self) -> None:
        with self._lock:
            budget, fd, owners = self._budget, self._root_fd, self._owners
            self._budget, self._root_fd, self._owners = None, None, None
        if budget is not None:
            budget.close()
        if owners is not None:
            owners.close()
        if fd is not None:
            os.close(fd)

    # -- helpers ------------------------------------------------------------------------
    def _read_error(self, path: Path, err: OSError) -> bool:
        log.warning("disk tier: cannot read %s: %s", path, err)
        with self._lock:
            self._stats.errors += 1
            self._stats.misses += 1
        return False

    def _not_regular(self, key: ChunkKey, dfd: int, name: str, st: os.stat_result) -> bool:
        """A FIFO, socket, device node or directory under ``key``'s name: a miss,
        counted (``not_regular``), and the entry removed if it is still there."""
        self._drop_odd(dfd, name, st)
        with self._lock:
            self._forget(key)
            self._stats.misses += 1
            self._extra["not_regular"] += 1
        return False

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

    def _miss(self, key: ChunkKey, *, keep: bool = False) -> bool:
        with self._lock:
            if not keep:
                self._forget(key)
            self._stats.misses += 1
        return False

    def _read_verified(
        self, fd: int, offset: int, dst: memoryview, header: FrameHeader, key: ChunkKey, path: Path, ino: int
    ) -> bool:
        """Read the payload into ``dst`` while hashing it; a short or corrupt file, or
        one sealed otherwise than this tier reads, is dropped and the read is a miss."""
        try:
            hasher = FrameReader(seal=self._seal).verifier(header)
        except FrameError as err:
            self._drop_corrupt(key, path, ino, str(err))
            return False
        try:
            read_into_hasher(fd, offset, dst, hasher, pool=self._pool)
        except EOFError as err:
            self._drop_corrupt(key, path, ino, str(err))
            return False
        if not hasher.matches():
            self._drop_corrupt(key, path, ino, "MAC mismatch" if self._seal is not None else "checksum mismatch")
            return False
        return True

    def _drop_corrupt(self, key: ChunkKey, path: Path, ino: int | None, reason: str) -> None:
        """Remove a file that failed verification, unless another writer has since
        replaced it with a new file (different inode)."""
        log.warning("disk tier: %s is not a valid frame for its key (%s); removed", path, reason)
        self._unlink_counted(key, ino)
        with self._lock:
            self._forget(key)
            self._stats.misses += 1
            self._stats.errors += 1
            self._extra["corrupt_removed"] += 1


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


def create_disk_backend(section: Mapping[str, Any], ctx: BackendContext) -> DiskBackend:
    """Factory registered as ``disk``: validates the section, then opens the tier."""
    cfg = validate_section(DiskConfig, section, ctx.key_path, ctx.source)
    policy = None
    if cfg.eviction != "lru":
        plugins = ctx.plugins or get_plugin_manager()
        key_path = f"{ctx.key_path}.eviction"
        plugins.create_eviction_policy(cfg.eviction, cfg.max_size, key_path=key_path, source=ctx.source)  # checked now

        def policy() -> EvictionPolicy:
            return plugins.create_eviction_policy(cfg.eviction, cfg.max_size, key_path=key_path, source=ctx.source)

    return DiskBackend(cfg, codec=ctx.codec, codecs=ctx.codecs, key_path=ctx.key_path, source=ctx.source, policy=policy)
