"""File I/O for chunk frames: durable writes into a temp file and whole-file reads,
with optional O_DIRECT, all relative to a directory descriptor and never through a
symbolic link (``O_NOFOLLOW``).

Every file the tier opens in its directory is opened by :func:`open_regular` (or
:func:`open_temp`): ``O_NONBLOCK`` so that a FIFO planted under a chunk or temp
name cannot block the open (a FIFO opened for reading waits for a writer, and for
writing waits for a reader), ``O_NOCTTY`` so a terminal device never becomes the
process's controlling terminal, then ``fstat``: anything but a regular file raises
:class:`NotRegularFile` before a byte is read or written (a read from a FIFO would
block too), and the descriptor is made blocking again for the I/O.

A chunk becomes visible only by ``rename`` of a complete, fsynced temp file in the
same directory (the backend renames it, under the directory's budget lock), so a
crash at any point leaves either the old state or the whole new file, never a
partial chunk under a chunk name. O_DIRECT needs aligned buffers, offsets and
lengths: writes pad to the alignment and truncate back, reads use an aligned
buffer; where the filesystem refuses O_DIRECT (tmpfs, some FUSE) the caller probes
once with :func:`probe_o_direct` and falls back to buffered I/O.
"""

from __future__ import annotations

import errno
import os
import queue
import stat
from concurrent.futures import Executor
from pathlib import Path
from typing import Callable, NoReturn, Protocol, Sequence

import numpy as np

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_GUARD = os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | _O_NOFOLLOW | _O_CLOEXEC
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | _O_GUARD
_READ_FLAGS = os.O_RDONLY | _O_GUARD
# open() of these names fails with one of these when they are not regular files
# (ENXIO: a socket, or a FIFO opened for writing without a reader; ENODEV/EOPNOTSUPP:
# device nodes without a driver; EISDIR, EINVAL: a directory opened for writing or with
# O_DIRECT): the caller learns what the name is from lstat
_ODD_ERRNOS = {errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ETXTBSY}


class NotRegularFile(OSError):
    """A name the tier reads or writes is not a regular file (a FIFO, socket, device
    node or directory). ``st`` is its ``lstat`` (or ``fstat``): callers remove the
    entry only if the name still refers to that same inode."""

    def __init__(self, name: str, st: os.stat_result) -> None:
        super().__init__(errno.EINVAL, f"not a regular file (mode {stat.filemode(st.st_mode)})", name)
        self.st = st


def _odd_or_raise(name: str, dir_fd: int | None, err: OSError) -> NoReturn:
    """``open`` of ``name`` failed with ``err``: raise :class:`NotRegularFile` if the
    name is something other than a regular file or a link, else ``err``."""
    if err.errno in _ODD_ERRNOS:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise err from None
        if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            raise NotRegularFile(name, st) from err
    raise err


def open_regular(name: str, *, dir_fd: int | None, flags: int = _READ_FLAGS, mode: int = 0o644) -> tuple[int, os.stat_result]:
    """Open ``name`` (relative to ``dir_fd``; never through a link, never blocking on
    a FIFO) and return the descriptor, blocking again, with its ``fstat``; raises
    :class:`NotRegularFile` for anything but a regular file, OSError otherwise
    (ELOOP for a link)."""
    try:
        fd = os.open(name, flags | _O_GUARD, mode, dir_fd=dir_fd)
    except OSError as err:
        _odd_or_raise(name, dir_fd, err)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(name, st)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose address is ``align``-aligned."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes]


def probe_o_direct(directory: Path) -> str | None:
    """None when O_DIRECT writes and reads work in ``directory``, else the reason."""
    if not _O_DIRECT:
        return "O_DIRECT is not available on this platform"
    probe = directory / f".tmp-{os.getpid()}-odirect-probe"
    try:  # O_NOFOLLOW: a link planted under the probe's name is refused, never truncated; nor a FIFO opened
        fd, _ = open_regular(str(probe), dir_fd=None, flags=os.O_CREAT | os.O_RDWR | os.O_TRUNC | _O_DIRECT)
    except NotRegularFile as err:
        return f"O_DIRECT not probed in {directory}: {probe.name} {err.strerror}"
    except OSError as err:
        try:  # some filesystems create the file, then refuse O_DIRECT: remove it, never a link
            if stat.S_ISREG(os.lstat(probe).st_mode):
                os.unlink(probe)
        except OSError:
            pass
        return f"O_DIRECT refused in {directory}: {err.strerror or err}"
    try:
        buf = aligned_empty(ALIGN)
        buf[:] = 0
        os.write(fd, buf)
        os.lseek(fd, 0, os.SEEK_SET)
        os.readv(fd, [buf])
    except OSError as err:
        return f"O_DIRECT refused in {directory}: {err.strerror or err}"
    finally:
        os.close(fd)
        try:
            os.unlink(probe)  # only a file this call opened (created or truncated) as a regular file
        except OSError:
            pass
    return None


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]


def write_atomic(temp: str, parts: Sequence[bytes | memoryview], *, dir_fd: int, fsync: bool, o_direct: bool) -> None:
    """Write the concatenation of ``parts`` to the temp file ``temp`` in the
    directory ``dir_fd`` and make it durable (``fsync``). The caller renames it into
    place, or removes it when this raises."""
    views = [memoryview(p).cast("B") for p in parts]
    if o_direct:
        size = sum(v.nbytes for v in views)
        padded = aligned_empty(-(-size // ALIGN) * ALIGN)
        pos = 0
        for v in views:
            padded[pos : pos + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
            pos += v.nbytes
        padded[size:] = 0
        fd, _ = open_regular(temp, dir_fd=dir_fd, flags=_TEMP_FLAGS | _O_DIRECT)
        try:
            _write_all(fd, memoryview(padded))
            os.ftruncate(fd, size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    else:
        fd, _ = open_regular(temp, dir_fd=dir_fd, flags=_TEMP_FLAGS)
        try:
            for v in views:
                _write_all(fd, v)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


def read_whole(name: str, *, dir_fd: int, o_direct: bool, max_bytes: int) -> tuple[np.ndarray, int]:
    """The bytes of the file ``name`` in the directory ``dir_fd`` (never through a
    link) and its inode number (to tell it apart from a file that replaced it
    later). Raises OSError (FileNotFoundError on a miss, ELOOP for a link,
    :class:`NotRegularFile` for a FIFO and the like), or ValueError when the file is
    larger than ``max_bytes``."""
    fd, st = open_regular(name, dir_fd=dir_fd, flags=_READ_FLAGS | (_O_DIRECT if o_direct else 0))
    try:
        size = st.st_size
        if size > max_bytes:
            raise ValueError(f"{name} is {size} bytes, more than any frame ({max_bytes})")
        cap = -(-size // ALIGN) * ALIGN if o_direct else size
        buf = aligned_empty(max(cap, ALIGN) if o_direct else cap)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        return buf[:got], st.st_ino
    finally:
        os.close(fd)


# -- two-part frames, hashed while the disk moves the payload ---------------------------------
SEGMENT = 1 << 20
_OVERLAP_MIN = 2 * SEGMENT


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view[:SEGMENT], offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view, offset = view[n:], offset + n


def write_parts(
    temp: str,
    *,
    dir_fd: int,
    header_len: int,
    payload: memoryview,
    make_header: Callable[[], bytes],
    fsync: bool,
    pool: Executor | None = None,
) -> None:
    """Like :func:`write_atomic` for a frame given as a payload plus a header that
    is computed (the payload hashed) by ``make_header`` while a pool thread writes the
    payload at ``header_len``. The header must be exactly ``header_len`` bytes."""
    fd, _ = open_regular(temp, dir_fd=dir_fd, flags=_TEMP_FLAGS)
    try:
        fut = pool.submit(_pwrite_all, fd, payload, header_len) if pool and payload.nbytes >= _OVERLAP_MIN else None
        try:
            header = make_header()
        finally:
            if fut is not None:
                fut.result()  # never leave a thread writing to a closed fd
        if fut is None:
            _pwrite_all(fd, payload, header_len)
        if len(header) != header_len:
            raise RuntimeError(f"frame header is {len(header)} bytes, expected {header_len}")
        _pwrite_all(fd, memoryview(header), 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _pread_segments(fd: int, dst: memoryview, offset: int, done: "queue.SimpleQueue[object]") -> None:
    pos = 0
    try:
        while pos < dst.nbytes:
            n = os.preadv(fd, [dst[pos : pos + SEGMENT]], offset + pos)
            if n == 0:
                raise EOFError(f"file ends {dst.nbytes - pos} bytes early")
            pos += n
            done.put(pos)
    except BaseException as err:  # handed to the consumer
        done.put(err)


class Hasher(Protocol):
    """A streaming hash (``serde.payload_hasher``'s)."""

    def update(self, data: memoryview, /) -> None: ...


def _read_cached(fd: int, offset: int, dst: memoryview, hasher: Hasher) -> int:
    """Read and hash, on the calling thread, the leading segments of ``dst`` that are
    already in the page cache (``RWF_NOWAIT`` reads never wait for the disk); return
    how many bytes that covered. For a warm file (the common case for a hot cache)
    this is everything, and it is faster than handing segments between threads."""
    pos = 0
    while pos < dst.nbytes:
        try:
            n = os.preadv(fd, [dst[pos : pos + SEGMENT]], offset + pos, _RWF_NOWAIT)
        except BlockingIOError:  # not cached: the disk has to move it
            break
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystem without NOWAIT reads
                break
            raise
        if n == 0:
            raise EOFError(f"file ends {dst.nbytes - pos} bytes early")
        hasher.update(dst[pos : pos + n])
        pos += n
    return pos


def read_into_hasher(fd: int, offset: int, dst: memoryview, hasher: Hasher, *, pool: Executor | None) -> None:
    """Read ``dst.nbytes`` bytes at ``offset`` into ``dst``, feeding them in order
    to ``hasher``. What is in the page cache is read and hashed on the calling
    thread; the rest is read by a pool thread in segments, each hashed while the
    next one is read. Raises OSError, or EOFError when the file is shorter. When it
    returns or raises, nothing writes into ``dst`` any more."""
    if _RWF_NOWAIT:
        done_bytes = _read_cached(fd, offset, dst, hasher)
        if done_bytes == dst.nbytes:
            return
        dst, offset = dst[done_bytes:], offset + done_bytes
    done: queue.SimpleQueue[object] = queue.SimpleQueue()
    if hasattr(os, "posix_fadvise") and dst.nbytes >= _OVERLAP_MIN:
        try:  # start readahead of the whole payload; the segment reads then mostly wait less
            os.posix_fadvise(fd, offset, dst.nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
    if pool is None or dst.nbytes < _OVERLAP_MIN:
        _pread_segments(fd, dst, offset, done)
        fut = None
    else:
        fut = pool.submit(_pread_segments, fd, dst, offset, done)
    pos = 0
    try:
        while pos < dst.nbytes:
            item = done.get(timeout=600)
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, int)
            hasher.update(dst[pos:item])
            pos = item
    finally:
        if fut is not None:
            fut.result(timeout=600)
