"""The disk tier's directory: set-up (the directory, its marker, the shards), the
descriptors and locks the tier holds on it, and access to its shard directories
without ever following a link.

:class:`DirAccess` is the lowest layer of :class:`~.backend.DiskBackend` (see
backend.py for the layers); it also declares the state the layers share, all of
it guarded by ``_lock`` unless noted.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from lmcache_core.backend import BackendStats, StorageBackend
from lmcache_core.config import ConfigError
from lmcache_core.eviction import EvictionPolicy
from lmcache_core.keys import ChunkKey
from lmcache_core.frames import Codec

from .budget import DirBudget
from .config import DiskConfig
from .directory import FANOUT, MARKER_TEXT, USAGE, TierDirectory, open_dir, shard_name
from .index import LruIndex
from .owners import Owners, TempJudge

log = logging.getLogger("lmcache_backend_disk.backend")


class ShardRefused(Exception):
    """The shard directory is a symbolic link or not a directory: never entered."""


class DirAccess(StorageBackend):
    """The tier directory and its shards; the state every layer shares."""

    cfg: DiskConfig
    root: Path
    directory: TierDirectory
    max_size: int
    _make_policy: Callable[[], EvictionPolicy] | None
    _codec: Codec
    _codecs: dict[str, Codec]
    _seal: Any  # the codec's FrameSeal or None (FrameWriter.seal_of)
    _lock: threading.Lock
    _index: LruIndex
    _last_put_error: str | None
    _closed: bool
    _root_fd: int | None
    _budget: DirBudget | None
    _owners: Owners | None
    _judge: TempJudge
    _relist_lock: threading.Lock  # one listing to learn the directory at a time
    _relists: int
    _refused_shards: set[str]
    _shards_checked: set[str]  # shards contains() has seen to be directories (or refused)
    _pool: ThreadPoolExecutor  # the parts of one read or write
    _batch: ThreadPoolExecutor  # get_many: whole reads in parallel
    _stats: BackendStats
    _extra: dict[str, Any]
    _o_direct: bool
    # the background start-up scan (startup.py); until its index is complete, chunks
    # it has listed wait in _found (key -> size) and in _found_heap (mtime order)
    _indexing: bool
    _found: dict[ChunkKey, int]
    _found_bytes: int
    _found_heap: list[tuple[int, int, ChunkKey]]
    _dropped: set[ChunkKey]
    _scan_stop: threading.Event
    _scan_done: threading.Event
    _scan_thread: threading.Thread | None
    _scan_running: bool  # under _lock: the scan thread has not finished
    _close_deferred: bool  # under _lock: close() left the directory to the scan thread

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

    def _set_dir_bytes(self, count: int | None) -> None:
        with self._lock:
            self._extra["dir_bytes"] = count

    @contextmanager
    def _shard(self, key: ChunkKey, *, create: bool = False) -> Iterator[int]:
        """The key's shard directory as a descriptor, opened without following a
        link; raises :class:`ShardRefused` for a link (logged once per shard) and
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
            raise ShardRefused(name) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_shard_or_refuse(self, name: str) -> int:
        try:
            return open_dir(name, self._root_fd)
        except OSError as err:
            self._refuse_shard(name, err)
            raise ShardRefused(name) from None

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
