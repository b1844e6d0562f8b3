"""Sizes and pieces of the serde frames this tier stores (one frame per object).

A frame is ``header + payload`` exactly as :func:`lmcache_core.serde.encode` builds
it, written from two buffers so the payload is never copied; a reader bounds the
object before the transfer by :func:`max_frame_len` and verifies it with
:func:`lmcache_core.serde.try_decode` (checksum, key, dtype, shape).
"""

from __future__ import annotations

import torch

from lmcache_core.keys import ChunkKey
from lmcache_core.serde import Codec, FrameSeal, checksum_placeholder, encode_parts, frame_codec, frame_header, frame_meta

LZ4_SLACK = 16  # LZ4's worst case is n + n/255 + 16
HEADER_SLACK = 64  # codec name and payload length digits may differ from the raw codec's


def max_frame_len(key: ChunkKey, out: torch.Tensor, seal: FrameSeal | None = None) -> int:
    """The largest frame a chunk for ``out`` can have (any installed codec; sealed
    with ``seal`` when given): a bigger object is not this chunk, and the transfer
    is refused before it moves a byte."""
    n = out.numel() * out.element_size()
    meta = frame_meta(key, out, "raw", n, seal=seal)
    header = frame_header(meta, checksum_placeholder(meta), n)
    return len(header) + HEADER_SLACK + n + n // 255 + LZ4_SLACK


def frame_parts(key: ChunkKey, data: torch.Tensor, codec: Codec) -> tuple[bytes, memoryview, bool]:
    """``(header, payload, in_place)``: ``in_place`` when the payload is ``data``'s own
    memory (raw codec, contiguous CPU tensor), so it can be written from there."""
    header, payload = encode_parts(key, data, codec)
    in_place = (
        data.device.type == "cpu"
        and data.is_contiguous()
        and payload.nbytes == data.numel() * data.element_size()
        and frame_codec(data, codec).name == "raw"
    )
    return header, payload, in_place
