"""The ``disk`` tier: one serde frame per chunk file, durable, shared by the
processes of one machine, LRU within a byte budget that holds across restarts.

Contract details (beyond :class:`lmcache_core.backend.StorageBackend`):

* A chunk becomes visible only as a complete, fsynced file (temp file + rename), so
  a reader in any process sees the whole frame or nothing; two writers of one key
  each rename a complete frame of that key, and the last rename wins.
* The directory is the truth; the in-memory index (key -> size, LRU order) is a view
  of it. ``contains`` and ``put`` check the filesystem, so files written or evicted by
  another process are noticed; ``get`` opens the file whatever the index says.
* ``get`` refreshes the file's mtime; the start-up scan orders the index by mtime, so
  LRU order survives restarts.
* Every failure is a miss or a skipped put, counted in :meth:`stats`: corrupt or
  foreign files are removed and never loaded; a full disk (ENOSPC) or a read-only
  directory makes ``put`` return False while reads go on.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from lmcache_core.backend import PERSISTENT, SHARED, BackendContext, BackendStats, StorageBackend
from lmcache_core.config import ConfigError, validate_section
from lmcache_core.keys import ChunkKey
from lmcache_core.serde import (
    CHECKSUM_HEX_LEN,
    DTYPE_NAMES,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    Codec,
    FrameError,
    frame_header,
    frame_meta,
    payload_checksum,
    payload_hasher,
    tensor_bytes,
    try_decode,
)

from .config import DiskConfig
from .fileio import probe_o_direct, read_into_hasher, read_whole, write_atomic, write_parts_atomic
from .frames import read_frame_header
from .index import LruIndex
from .layout import FANOUT, MARKER_TEXT, Layout
from .scan import scan

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 8 + MAX_HEADER_BYTES + MAX_PAYLOAD_BYTES
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskBackend(StorageBackend):
    name = "disk"
    capabilities = frozenset({PERSISTENT, SHARED})

    def __init__(
        self,
        cfg: DiskConfig,
        *,
        codec: Codec,
        codecs: Mapping[str, Codec],
        key_path: str = "disk",
        source: str = "code",
    ) -> None:
        t0 = time.perf_counter()
        self.cfg = cfg
        self.root = Path(cfg.path).expanduser()
        self.layout = Layout(self.root)
        self.max_size = cfg.max_size
        self._codec = codec
        self._codecs = dict(codecs)
        self._lock = threading.Lock()
        self._index = LruIndex()
        self._reserved = 0
        self._last_put_error: str | None = None
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="lmcache-disk-io")
        self._s = BackendStats(self.name, bytes_capacity=self.max_size)
        self._x: dict[str, Any] = {
            "path": str(self.root),
            "corrupt_removed": 0,
            "disk_full": 0,
            "write_errors": 0,
            "shape_mismatch": 0,
            "unavailable": None,
        }
        self._prepare_root(key_path, source)
        self._o_direct = False
        if cfg.o_direct and self._x["unavailable"] is None:
            reason = probe_o_direct(self.root)
            self._o_direct = reason is None
            if reason:
                log.warning("disk tier %s: o_direct requested, using buffered I/O: %s", self.root, reason)
            self._x["o_direct_fallback"] = reason
        self._x["o_direct"] = self._o_direct
        if self.root.is_dir():
            res = scan(self.root, verify=cfg.verify_on_start, pool=self._pool)
            self._index.load(res.entries)
            self._x.update(
                startup_stale_temps=res.stale_temps,
                startup_bad_removed=res.bad_removed,
                startup_foreign_removed=res.foreign_removed,
            )
            victims = self._index.pop_lru(self._index.bytes - self.max_size)
            self._delete(victims)
        self._x["startup_s"] = round(time.perf_counter() - t0, 4)

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
        if root.is_dir() and not self.layout.marker.exists():
            try:
                extra = [p.name for p in root.iterdir()][:3]
            except OSError as err:
                raise ConfigError(f"{where}: cannot list {root}: {err.strerror} (from {source})") from None
            if extra:
                raise ConfigError(
                    f"{where}: {root} is not empty and is not a disk tier (no {self.layout.marker.name} "
                    f"file; found e.g. {extra}); use an empty or new directory (from {source})"
                )
        try:
            root.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.layout.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(MARKER_TEXT)
            except FileExistsError:
                pass
            for shard in FANOUT:
                (root / shard).mkdir(exist_ok=True)
        except OSError as err:
            reason = f"cannot write {root}: {err.strerror or err}"
            self._x["unavailable"] = reason
            log.warning("disk tier: %s; puts will be skipped, reads go on", reason)

    # -- contract -----------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            try:
                st = os.stat(self.layout.chunk_path(key))
            except OSError:
                with self._lock:
                    self._index.discard(key)
                break
            with self._lock:
                if key not in self._index:
                    self._index.add(key, st.st_size)
            n += 1
        return n

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        if self._closed:
            return False
        path = self.layout.chunk_path(key)
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None:
            with self._lock:
                if not self._index.touch(key):
                    self._index.add(key, st.st_size)
            return True
        frame = self._frame(key, data)
        size = frame.size
        if size > self.max_size:
            with self._lock:
                self._index.discard(key)
                self._s.skipped += 1
            return False
        with self._lock:
            self._index.discard(key)
            victims = self._index.pop_lru(self._index.bytes + self._reserved + size - self.max_size)
            self._reserved += size
        self._delete(victims)
        try:
            self._write(key, path, frame)
        except OSError as err:
            with self._lock:
                self._reserved -= size
                if err.errno in _FULL_ERRNOS:
                    self._s.skipped += 1
                    self._x["disk_full"] += 1
                else:
                    self._s.errors += 1
                    self._x["write_errors"] += 1
            why = f"{type(err).__name__}: {err.strerror or err}"
            if why != self._last_put_error:  # one line per kind of failure, not per chunk
                self._last_put_error = why
                log.warning("disk tier %s: puts are failing (%s); counted in stats, serving goes on", self.root, why)
            return False
        with self._lock:
            self._reserved -= size
            self._index.add(key, size)
            self._s.puts += 1
            self._s.put_bytes += data.nbytes
            self._last_put_error = None
            over = self._index.bytes + self._reserved - self.max_size
            victims = self._index.pop_lru(over) if over > 0 else []
            if any(k == key for k, _ in victims):  # never evict the chunk just written
                victims = [v for v in victims if v[0] != key]
                self._index.add(key, size)
        self._delete(victims)
        return True

    def _frame(self, key: ChunkKey, data: torch.Tensor) -> "_PendingFrame":
        raw = tensor_bytes(data)
        payload = self._codec.encode(raw)
        mv = memoryview(payload).cast("B")
        meta = frame_meta(key, data, self._codec.name, raw.nbytes)
        return _PendingFrame(meta, mv)

    def _write(self, key: ChunkKey, path: Path, frame: "_PendingFrame") -> None:
        for attempt in (0, 1):
            temp = self.layout.temp_path(key)
            try:
                if self._o_direct:
                    parts = [frame.header(), frame.payload]
                    write_atomic(path, temp, parts, fsync=self.cfg.fsync, o_direct=True)
                else:
                    write_parts_atomic(
                        path,
                        temp,
                        header_len=frame.header_len,
                        payload=frame.payload,
                        make_header=frame.header,
                        fsync=self.cfg.fsync,
                        pool=self._pool,
                    )
                return
            except FileNotFoundError:
                if attempt:
                    raise
                path.parent.mkdir(parents=True, exist_ok=True)  # shard removed under us

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        if self._closed:
            return False
        path = self.layout.chunk_path(key)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError):
            return self._miss(key)
        except OSError as err:
            return self._read_error(path, err)
        try:
            st = os.fstat(fd)
            try:
                info, meta, offset = read_frame_header(fd, st.st_size)
            except FrameError as err:
                self._drop_corrupt(key, path, st.st_ino, str(err))
                return False
            if info.key != key.to_str():
                self._drop_corrupt(key, path, st.st_ino, f"file holds key {info.key}")
                return False
            unknown_codec = info.codec not in self._codecs
            if unknown_codec or info.dtype != DTYPE_NAMES.get(out.dtype) or info.shape != tuple(out.shape):
                # Not for this caller. Keep the file only if it is intact: a flipped
                # byte in the header can fake a foreign codec or another shape.
                scratch = memoryview(np.empty(info.payload_len, dtype=np.uint8))
                if not self._read_verified(fd, offset, scratch, meta, key, path, st.st_ino):
                    return False
                if unknown_codec:
                    log.warning("disk tier: %s uses codec %r, which is not installed here", path, info.codec)
                else:
                    with self._lock:
                        self._x["shape_mismatch"] += 1
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
                if not self._read_verified(fd, offset, dst, meta, key, path, st.st_ino):
                    return False
        except OSError as err:
            return self._read_error(path, err)
        finally:
            os.close(fd)
        if not direct:
            try:
                buf, ino = read_whole(path, o_direct=self._o_direct, max_bytes=MAX_FRAME_BYTES)
            except (FileNotFoundError, NotADirectoryError):
                return self._miss(key)
            except ValueError as err:
                self._drop_corrupt(key, path, None, str(err))
                return False
            except OSError as err:
                return self._read_error(path, err)
            _, reason = try_decode(buf, self._codecs, expect_key=key, out=out)
            if reason is not None:
                self._drop_corrupt(key, path, ino, reason)
                return False
        try:
            os.utime(path)
        except OSError:
            pass  # a read-only directory keeps its old LRU order
        with self._lock:
            if not self._index.touch(key):
                self._index.add(key, st.st_size)
            self._s.hits += 1
            self._s.get_bytes += out.nbytes
        return True

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            self._index.discard(key)
        try:
            os.unlink(self.layout.chunk_path(key))
        except OSError:
            return False
        return True

    def stats(self) -> BackendStats:
        with self._lock:
            s = BackendStats(**{**self._s.__dict__, "extra": dict(self._x)})
            s.chunks = len(self._index)
            s.bytes_used = self._index.bytes
        return s

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)

    # -- helpers ------------------------------------------------------------------------
    def _read_error(self, path: Path, err: OSError) -> bool:
        log.warning("disk tier: cannot read %s: %s", path, err)
        with self._lock:
            self._s.errors += 1
            self._s.misses += 1
        return False

    def _miss(self, key: ChunkKey, *, keep: bool = False) -> bool:
        with self._lock:
            if not keep:
                self._index.discard(key)
            self._s.misses += 1
        return False

    def _read_verified(self, fd: int, offset: int, dst: memoryview, meta: dict[str, str], key: ChunkKey, path: Path, ino: int) -> bool:
        """Read the payload into ``dst`` while hashing it; a short or corrupt file is
        dropped and the read is a miss."""
        hasher = payload_hasher(meta)
        try:
            read_into_hasher(fd, offset, dst, hasher, pool=self._pool)
        except EOFError as err:
            self._drop_corrupt(key, path, ino, str(err))
            return False
        if hasher.hexdigest() != meta["checksum"]:
            self._drop_corrupt(key, path, ino, "checksum mismatch")
            return False
        return True

    def _drop_corrupt(self, key: ChunkKey, path: Path, ino: int | None, reason: str) -> None:
        """Remove a file that failed verification, unless another writer has since
        replaced it with a new file (different inode)."""
        log.warning("disk tier: %s is not a valid frame for its key (%s); removed", path, reason)
        try:
            if ino is None or os.stat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass
        with self._lock:
            self._index.discard(key)
            self._s.misses += 1
            self._s.errors += 1
            self._x["corrupt_removed"] += 1

    def _delete(self, victims: list[tuple[ChunkKey, int]]) -> None:
        for key, _ in victims:
            try:
                os.unlink(self.layout.chunk_path(key))
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("disk tier: cannot evict %s: %s", key, err)
                continue
            with self._lock:
                self._s.evictions += 1


class _PendingFrame:
    """A frame about to be written: metadata plus payload. Its header (which holds
    the payload checksum) is computed by :meth:`header`, possibly while the payload
    is being written; its length is known up front (serde's header length does not
    depend on the checksum's value)."""

    def __init__(self, meta: dict[str, str], payload: memoryview) -> None:
        self.meta = meta
        self.payload = payload
        self.header_len = len(frame_header(meta, "0" * CHECKSUM_HEX_LEN, payload.nbytes))
        self.size = self.header_len + payload.nbytes

    def header(self) -> bytes:
        return frame_header(self.meta, payload_checksum(self.meta, self.payload), self.payload.nbytes)


def create_disk_backend(section: Mapping[str, Any], ctx: BackendContext) -> DiskBackend:
    """Factory registered as ``disk``: validates the section, then opens the tier."""
    cfg = validate_section(DiskConfig, section, ctx.key_path, ctx.source)
    return DiskBackend(cfg, codec=ctx.codec, codecs=ctx.codecs, key_path=ctx.key_path, source=ctx.source)
