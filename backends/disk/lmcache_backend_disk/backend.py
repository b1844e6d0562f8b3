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

Layout: :class:`DiskBackend` here is the coordinator (the contract methods); it
stands on layers, each a module and the base class of the next: access.py
(:class:`~.access.DirAccess`: the directory, its shards, the shared state),
catalog.py (:class:`~.catalog.Catalog`: the index), keeper.py
(:class:`~.keeper.BudgetKeeper`: the shared budget's lock protocol), startup.py
(:class:`~.startup.StartupScan`: the background scan) and chunkio.py
(:class:`~.chunkio.ChunkIO`: frames between tensors and files).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from lmcache_core.backend import (
    BATCHED,
    PERSISTENT,
    SHARED,
    BackendContext,
    BackendError,
    BackendStats,
    EraseMatch,
    StoredChunk,
    remove_each,
)
from lmcache_core.config import validate_section
from lmcache_core.eviction import EvictionPolicy
from lmcache_core.keys import ChunkKey
from lmcache_core.plugins import get_plugin_manager
from lmcache_core.frames import Codec, FrameWriter

from .access import ShardRefused
from .chunkio import ChunkIO
from .config import DiskConfig
from .directory import FANOUT, TierDirectory, open_dir, parse_chunk_name
from .owners import TempJudge, untrack
from .records import read_records, write_record

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0  # close() waits this long for the background scan to stop
SCAN_WAIT_S = 60.0  # stored_chunks() waits this long for the start-up scan's index


class DiskBackend(ChunkIO):
    """The coordinator: the contract methods, on the layers below (each a module,
    each a base class of the next): :class:`~.access.DirAccess` (the directory, its
    shards, the shared state), :class:`~.catalog.Catalog` (the index),
    :class:`~.keeper.BudgetKeeper` (the shared budget and its lock protocol),
    :class:`~.startup.StartupScan` (the background start-up scan) and
    :class:`~.chunkio.ChunkIO` (frames between tensors and files)."""

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
        self._last_put_error = None
        self._closed = False
        self._root_fd = None
        self._budget = None
        self._owners = None
        self._judge = TempJudge(None, cfg.max_size)
        self._relist_lock = threading.Lock()  # one listing to learn the directory at a time
        self._relists = 0
        self._refused_shards = set()
        self._shards_checked = set()  # shards contains() has seen to be directories (or refused)
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="lmcache-disk-io")
        # get_many: whole reads in parallel (each may use _pool for its parts)
        self._batch = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="lmcache-disk-batch")
        self._stats = BackendStats(self.name, bytes_capacity=self.max_size)
        self._extra = {
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
        self._setup_o_direct()
        self._start_scan()
        self._extra["startup_s"] = round(time.perf_counter() - t0, 4)

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
            self._note_seen(key, st.st_size)
            n += 1
        return n

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        if self._closed:
            return False
        try:
            with self._shard(key, create=True) as dfd:
                return self._put_in(key, data, dfd)
        except ShardRefused:
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
        except (FileNotFoundError, NotADirectoryError, ShardRefused):
            return self._miss(key)

    def stored_chunks(self, namespace: bytes) -> Iterator[StoredChunk]:
        """``namespace``'s chunks, most recently used first (the index's order, once the
        start-up scan is over: waited for at most ``SCAN_WAIT_S``), each with the shape
        and dtype of its frame header (one read per chunk, as the caller takes it)."""
        self.wait_for_scan(SCAN_WAIT_S)
        with self._lock:
            keys = [k for k in self._index.keys_lru_first() if k.namespace == namespace]
        for key in reversed(keys):
            if self._closed:
                return
            info = self._stored_header(key)
            if info is not None:
                yield StoredChunk(key, tuple(info.shape), info.dtype)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            self._forget(key)
        return self._unlink_counted(key) > 0

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """List every shard (the directory is the truth, whichever process wrote the
        files) and remove each chunk file ``match`` takes, as :meth:`remove` does
        (index and shared byte count too). A second listing checks that none is left:
        one that could not be removed now (the byte-count lock stayed busy) raises."""
        if self._closed or self._root_fd is None:
            raise BackendError(f"disk tier {self.root}: the directory is not open")
        keys = self._chunks_matching(match)
        if dry_run:
            return len(keys)
        n = remove_each(self.remove, keys, progress)
        left = sum(1 for _ in self._chunks_matching(match))
        if left:
            raise BackendError(f"disk tier {self.root}: {left} matching chunk file(s) could not be removed ({n} were)")
        return n

    def record_namespace(self, namespace: bytes, record: bytes) -> None:
        """A file in the directory's root (:mod:`.records`); OSError when it cannot be written."""
        if self._closed or self._root_fd is None or self._budget is None:
            raise BackendError(f"disk tier {self.root}: the directory is not open for writing")
        write_record(self._root_fd, namespace, record)

    def namespace_records(self) -> dict[bytes, bytes]:
        if self._closed or self._root_fd is None:
            raise BackendError(f"disk tier {self.root}: the directory is not open")
        try:
            return read_records(self._root_fd)
        except OSError as err:
            raise BackendError(f"disk tier {self.root}: cannot list its namespace records: {err.strerror}") from None

    def _chunks_matching(self, match: EraseMatch) -> list[ChunkKey]:
        """The keys of the chunk files ``match`` takes, from a listing of every shard
        (opened without following links; a shard that is not a directory is skipped)."""
        found: list[ChunkKey] = []
        for shard in FANOUT:
            try:
                fd = open_dir(shard, self._root_fd)
            except FileNotFoundError:
                continue
            except OSError as err:
                raise BackendError(f"disk tier {self.root}: cannot list shard {shard}: {err.strerror}") from None
            try:
                names = os.listdir(fd)
            finally:
                os.close(fd)
            for name in names:
                key = parse_chunk_name(shard, name)
                if key is not None and match(key):
                    found.append(key)
        return found

    def stats(self) -> BackendStats:
        with self._lock:
            s = self._stats.snapshot()
            s.extra = dict(self._extra)
            s.chunks = len(self._index) + len(self._found)
            s.bytes_used = self._index.bytes + self._found_bytes
        return s

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
