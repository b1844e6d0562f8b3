"""A cheap structural check of a frame from its first bytes, for the start-up scan.

Decoding every file at start-up would read the whole cache; reading only the header
still catches what a crash or a stray copy leaves behind: a file shorter or longer
than its header says (truncated), or a header for a different key (foreign). Payload
corruption is caught later by the full checksum on ``get``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from lmcache_core.serde import FRAME_FORMAT, MAX_HEADER_BYTES, FrameError

_U64 = struct.Struct("<Q")
PREFIX_READ = 4096


def check_frame_file(path: Path, size: int, expect_key: str) -> None:
    """Raise :class:`FrameError` unless ``path`` (``size`` bytes) starts with a frame
    header for ``expect_key`` whose lengths add up to exactly ``size``."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(PREFIX_READ)
        if len(head) < 8:
            raise FrameError("truncated: shorter than the length prefix")
        (hlen,) = _U64.unpack_from(head, 0)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
            raise FrameError(f"bad header length {hlen}")
        if 8 + hlen > len(head):
            head += f.read(8 + hlen - len(head))
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


