"""Frame headers on disk: a cheap structural check for the start-up scan, and the
header read of the I/O path.

The structural check:

Decoding every file at start-up would read the whole cache; reading only the header
still catches what a crash or a stray copy leaves behind: a file shorter or longer
than its header says (truncated), a header for a different key (foreign), or a frame
of another format. Payload corruption is caught later by the full checksum on ``get``.

The tier writes and reads a frame in two parts (header, payload) so the payload
moves between the disk and the caller's tensor without the extra copies of
``serde.encode`` / ``serde.decode`` and is hashed while the disk moves it. Every
piece of the format comes from ``lmcache_core.frames`` (``FrameWriter``,
``FrameHeader``, ``FrameReader.verifier``), so the bytes on disk are exactly
``serde.encode``'s (tests compare them byte for byte).
"""

from __future__ import annotations

import os

from lmcache_core.frames import FrameError, FrameHeader

from .fileio import open_regular

PREFIX_READ = 4096


def read_frame_header(fd: int, size: int) -> tuple[FrameHeader, dict[str, str], int]:
    """Read and validate the header of the frame file open as ``fd`` (``size``
    bytes): one read of :data:`PREFIX_READ` bytes, a second only for a header that
    is longer. Returns the header, its metadata and the payload offset; raises
    :class:`~lmcache_core.frames.FrameError` or OSError."""
    head = os.pread(fd, PREFIX_READ, 0)
    if len(head) >= 8:
        span = FrameHeader.span(head)
        if len(head) < span <= size:
            head += os.pread(fd, span - len(head), len(head))
    header = FrameHeader.parse(head, size)
    return header, dict(header.meta or {}), header.offset


def check_frame_file(name: str, size: int | None, expect_key: str, *, dir_fd: int | None = None) -> FrameHeader:
    """The header of the file ``name`` in the directory ``dir_fd`` (never opened
    through a link, never a FIFO or other non-regular file:
    :class:`~.fileio.NotRegularFile`); raise :class:`~lmcache_core.frames.FrameError`
    unless it is a valid frame header for ``expect_key`` whose lengths add up to
    exactly ``size`` bytes (None: the file's size as opened)."""
    fd, st = open_regular(name, dir_fd=dir_fd)
    try:
        info, _, _ = read_frame_header(fd, st.st_size if size is None else size)
    finally:
        os.close(fd)
    if info.key != expect_key:
        raise FrameError(f"file holds key {info.key!r}")
    return info
