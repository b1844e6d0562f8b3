"""Sizes and pieces of the serde frames this tier stores (one frame per object).

A frame is ``header + payload`` exactly as :class:`lmcache_core.frames.FrameWriter`
builds it, written from two buffers so the payload is never copied; a reader bounds
the object before the transfer by :func:`max_frame_len` and verifies it with
:meth:`lmcache_core.frames.FrameReader.decode` (checksum, key, dtype, shape).
"""

from __future__ import annotations

import torch

from lmcache_core.keys import ChunkKey
from lmcache_core.frames import Codec, FrameSeal, FrameWriter

LZ4_SLACK = 16  # LZ4's worst case is n + n/255 + 16
HEADER_SLACK = 64  # codec name and payload length digits may differ from the raw codec's


def max_frame_len(key: ChunkKey, out: torch.Tensor, seal: FrameSeal | None = None) -> int:
    """The largest frame a chunk for ``out`` can have (any installed codec; sealed
    with ``seal`` when given): a bigger object is not this chunk, and the transfer
    is refused before it moves a byte."""
    n = out.numel() * out.element_size()
    return FrameWriter.header_size(key, out, seal=seal) + HEADER_SLACK + n + n // 255 + LZ4_SLACK


def frame_parts(key: ChunkKey, data: torch.Tensor, codec: Codec) -> tuple[bytes, memoryview, bool]:
    """``(header, payload, in_place)``: ``in_place`` when the payload is ``data``'s own
    memory (raw codec, contiguous CPU tensor), so it can be written from there."""
    frame = FrameWriter(key, data, codec)
    return frame.header(), frame.payload, frame.zero_copy
