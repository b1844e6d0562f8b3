"""Frame headers on disk: a cheap structural check for the start-up scan, and frames
written and read in two parts (header, payload) for the I/O path.

The structural check:

Decoding every file at start-up would read the whole cache; reading only the header
still catches what a crash or a stray copy leaves behind: a file shorter or longer
than its header says (truncated), or a header for a different key (foreign). Payload
corruption is caught later by the full checksum on ``get``.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import torch

from lmcache_core.keys import ChunkKey
from lmcache_core.serde import (
    DTYPE_NAMES,
    FRAME_FORMAT,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    FrameError,
    FrameInfo,
    parse_header,
)

_U64 = struct.Struct("<Q")
PREFIX_READ = 4096


def check_frame_file(path: str, size: int, expect_key: str) -> None:
    """Raise :class:`FrameError` unless ``path`` (``size`` bytes) starts with a frame
    header for ``expect_key`` whose lengths add up to exactly ``size``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        head = os.pread(fd, PREFIX_READ, 0)
        if len(head) < 8:
            raise FrameError("truncated: shorter than the length prefix")
        (hlen,) = _U64.unpack_from(head, 0)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
            raise FrameError(f"bad header length {hlen}")
        if 8 + hlen > len(head):
            head += os.pread(fd, 8 + hlen - len(head), len(head))
    finally:
        os.close(fd)
    try:
        header = json.loads(head[8 : 8 + hlen])
        meta = header["__metadata__"]
        lo, hi = (int(x) for x in header["payload"]["data_offsets"])
    except (ValueError, TypeError, KeyError):
        raise FrameError("header is malformed") from None
    if not isinstance(meta, dict) or meta.get("format") != FRAME_FORMAT:
        raise FrameError("not a frame of a known format")
    if meta.get("key") != expect_key:
        raise FrameError(f"file holds key {meta.get('key')!r}")
    if lo != 0 or 8 + hlen + (hi - lo) != size:
        raise FrameError(f"length mismatch: header says {8 + hlen + hi - lo} bytes, file has {size}")


# -- frames in parts -------------------------------------------------------------------------
# serde.encode returns one ``bytes`` (three copies of the payload plus a serial CRC) and
# serde.decode needs the whole frame in memory. For multi-MiB chunks on disk that
# costs more than the I/O itself, so the tier writes and reads a frame in two parts,
# header and payload, and checksums the payload while the disk moves it. The bytes on
# disk are exactly serde.encode's (tests compare them byte for byte), and headers are
# validated by serde.parse_header itself. The two helpers below mirror serde's
# private checksum seed; the core change that makes them unnecessary is a public
# ``serde.encode_parts`` / ``serde.verify_payload``.


def meta_crc(meta: dict[str, str]) -> int:
    """The CRC seed serde chains the payload onto (metadata minus the checksum)."""
    canon = json.dumps({k: v for k, v in sorted(meta.items()) if k != "checksum"}, separators=(",", ":"))
    return zlib.crc32(canon.encode())


def frame_meta(key: ChunkKey, tensor: torch.Tensor, codec_name: str, raw_len: int) -> dict[str, str]:
    if tensor.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {tensor.dtype} cannot be framed")
    return {
        "format": FRAME_FORMAT,
        "codec": codec_name,
        "dtype": DTYPE_NAMES[tensor.dtype],
        "shape": json.dumps(list(tensor.shape)),
        "key": key.to_str(),
        "raw_len": str(raw_len),
    }


def frame_header(meta: dict[str, str], checksum: int, payload_len: int) -> bytes:
    """Length prefix + padded JSON header; its length does not depend on ``checksum``."""
    full = {**meta, "checksum": f"{checksum:08x}"}
    header = json.dumps(
        {"__metadata__": full, "payload": {"dtype": "U8", "shape": [payload_len], "data_offsets": [0, payload_len]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    return _U64.pack(len(header)) + header


def parse_frame_header(head: bytes, size: int) -> tuple[FrameInfo, dict[str, str], int]:
    """Validate a frame's header from its first bytes and the file size, with
    serde.parse_header (the payload is stood in for by lazily zeroed memory that is
    never touched). Returns the info, the metadata and the payload offset; raises
    :class:`FrameError`."""
    if len(head) < 8:
        raise FrameError("truncated: shorter than the length prefix")
    (hlen,) = _U64.unpack_from(head, 0)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > min(size, len(head)):
        raise FrameError(f"bad header length {hlen}")
    if size > 8 + MAX_HEADER_BYTES + MAX_PAYLOAD_BYTES:
        raise FrameError(f"file of {size} bytes is larger than any frame")
    stand_in = np.zeros(size, dtype=np.uint8)  # calloc: pages stay untouched
    stand_in[: 8 + hlen] = np.frombuffer(head, dtype=np.uint8, count=8 + hlen)
    info, meta, _ = parse_header(memoryview(stand_in))
    return info, meta, 8 + hlen
