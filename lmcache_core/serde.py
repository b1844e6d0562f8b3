"""One self-describing frame per chunk, for every tier that stores bytes.

The container is safetensors' (so ``safetensors`` can open a frame for inspection):
an 8-byte little-endian header length, a JSON header, then the payload. Our fields
live in ``__metadata__``: format version, codec, dtype, shape, key, raw length, and a
CRC32 over the metadata and the payload. Decoding is our own strict parser: it never
runs pickle, bounds every length before allocating, and turns *any* inconsistency
into :class:`FrameError` (a cache miss with a reason), never into data.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .keys import ChunkKey

FRAME_FORMAT = "lmcache-core/1"
MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 1 << 34
_U64 = struct.Struct("<Q")
_CHECKSUM_RE = re.compile(r"[0-9a-f]{8}")

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class FrameError(Exception):
    """The bytes are not a valid frame for the expected chunk. Always a cache miss."""


class Codec(Protocol):
    """A payload codec. ``decode`` gets the exact raw length from the (checksummed)
    header and must fail (raise) rather than return a different length."""

    name: str

    def encode(self, raw: memoryview) -> bytes | memoryview: ...

    def decode(self, payload: memoryview, raw_len: int) -> bytes | memoryview: ...


class RawCodec:
    name = "raw"

    def encode(self, raw: memoryview) -> memoryview:
        return raw

    def decode(self, payload: memoryview, raw_len: int) -> memoryview:
        return payload


class Lz4Codec:
    name = "lz4"

    def encode(self, raw: memoryview) -> bytes:
        import lz4.block

        return lz4.block.compress(raw, store_size=False)

    def decode(self, payload: memoryview, raw_len: int) -> bytes:
        import lz4.block

        return lz4.block.decompress(payload, uncompressed_size=raw_len)


@dataclass(frozen=True)
class FrameInfo:
    key: str
    codec: str
    dtype: str
    shape: tuple[int, ...]
    raw_len: int
    payload_len: int


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _meta_crc(meta: dict[str, str]) -> int:
    canon = json.dumps({k: v for k, v in sorted(meta.items()) if k != "checksum"}, separators=(",", ":"))
    return zlib.crc32(canon.encode())


def encode(key: ChunkKey, tensor: torch.Tensor, codec: Codec) -> bytes:
    """Serialize one chunk into a frame."""
    if tensor.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {tensor.dtype} cannot be framed")
    raw = tensor_bytes(tensor)
    payload = codec.encode(raw)
    payload_len = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
    meta = {
        "format": FRAME_FORMAT,
        "codec": codec.name,
        "dtype": DTYPE_NAMES[tensor.dtype],
        "shape": json.dumps(list(tensor.shape)),
        "key": key.to_str(),
        "raw_len": str(raw.nbytes),
    }
    meta["checksum"] = f"{zlib.crc32(payload, _meta_crc(meta)):08x}"
    header = json.dumps(
        {"__metadata__": meta, "payload": {"dtype": "U8", "shape": [payload_len], "data_offsets": [0, payload_len]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    out = bytearray(8 + len(header) + payload_len)
    out[:8] = _U64.pack(len(header))
    out[8 : 8 + len(header)] = header
    out[8 + len(header) :] = payload
    return bytes(out)


def parse_header(frame: bytes | bytearray | memoryview) -> tuple[FrameInfo, dict[str, str], memoryview]:
    """Validate the header; return its info, the raw metadata and the payload view."""
    mv = memoryview(frame).cast("B")
    if mv.nbytes < 8:
        raise FrameError("truncated: shorter than the length prefix")
    (hlen,) = _U64.unpack_from(mv, 0)
    if hlen > MAX_HEADER_BYTES or hlen > mv.nbytes - 8:
        raise FrameError(f"bad header length {hlen}")
    try:
        header = json.loads(bytes(mv[8 : 8 + hlen]))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FrameError("header is not valid JSON") from None
    if not isinstance(header, dict) or set(header) != {"__metadata__", "payload"}:
        raise FrameError("header has the wrong fields")
    meta, entry = header["__metadata__"], header["payload"]
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FrameError("metadata is malformed")
    need = {"format", "codec", "dtype", "shape", "key", "raw_len", "checksum"}
    if set(meta) != need:
        raise FrameError("metadata has the wrong fields")
    if meta["format"] != FRAME_FORMAT:
        raise FrameError(f"unknown frame format {meta['format']!r}")
    if meta["dtype"] not in DTYPES:
        raise FrameError(f"unknown dtype {meta['dtype']!r}")
    if not _CHECKSUM_RE.fullmatch(meta["checksum"]):
        raise FrameError("checksum field is malformed")
    try:
        shape = tuple(json.loads(meta["shape"]))
        raw_len = int(meta["raw_len"])
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError
        offsets = entry["data_offsets"]
        if entry.get("dtype") != "U8" or not (isinstance(offsets, list) and len(offsets) == 2):
            raise ValueError
        lo, hi = int(offsets[0]), int(offsets[1])
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise FrameError("metadata values are malformed") from None
    payload_len = hi - lo
    if lo != 0 or payload_len < 0 or payload_len > MAX_PAYLOAD_BYTES or entry.get("shape") != [payload_len]:
        raise FrameError("bad payload offsets")
    if 8 + hlen + payload_len != mv.nbytes:
        raise FrameError(f"length mismatch: header says {payload_len} payload bytes, frame has {mv.nbytes - 8 - hlen}")
    itemsize = torch.empty((), dtype=DTYPES[meta["dtype"]]).element_size()
    if math.prod(shape) * itemsize != raw_len or raw_len > MAX_PAYLOAD_BYTES:
        raise FrameError("shape, dtype and raw length disagree")
    info = FrameInfo(meta["key"], meta["codec"], meta["dtype"], shape, raw_len, payload_len)
    return info, meta, mv[8 + hlen :]


def decode(
    frame: bytes | bytearray | memoryview,
    codecs: dict[str, Codec],
    *,
    expect_key: ChunkKey | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode and verify a frame. With ``out``, the data is written into it (its
    dtype and shape must match the frame) and ``out`` is returned."""
    info, meta, payload = parse_header(frame)
    if expect_key is not None and info.key != expect_key.to_str():
        raise FrameError(f"key mismatch: frame holds {info.key}")
    if zlib.crc32(payload, _meta_crc(meta)) != int(meta["checksum"], 16):
        raise FrameError("checksum mismatch")
    codec = codecs.get(info.codec)
    if codec is None:
        raise FrameError(f"codec {info.codec!r} is not installed")
    try:
        raw = codec.decode(payload, info.raw_len)
    except Exception as err:  # a codec library error on bad bytes is a miss
        raise FrameError(f"codec {info.codec} failed: {err}") from None
    raw_len = raw.nbytes if isinstance(raw, memoryview) else len(raw)
    if raw_len != info.raw_len:
        raise FrameError("decoded length differs from the header")
    dtype = DTYPES[info.dtype]
    if out is not None:
        if out.dtype != dtype or tuple(out.shape) != info.shape:
            raise FrameError(
                f"frame holds {info.dtype}{list(info.shape)}, caller expects "
                f"{DTYPE_NAMES.get(out.dtype, out.dtype)}{list(out.shape)}"
            )
        if info.raw_len == 0:
            return out
        if out.is_contiguous() and out.device.type == "cpu":
            out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
        else:
            out.copy_(torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(dtype).reshape(info.shape))
        return out
    if info.raw_len == 0:  # torch cannot reinterpret an empty byte view
        return torch.empty(info.shape, dtype=dtype)
    arr = np.frombuffer(raw, dtype=np.uint8).copy()
    return torch.from_numpy(arr).view(dtype).reshape(info.shape)


def try_decode(
    frame: bytes | bytearray | memoryview | None,
    codecs: dict[str, Codec],
    *,
    expect_key: ChunkKey | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, str | None]:
    """``decode`` that returns ``(None, reason)`` instead of raising."""
    if frame is None:
        return None, "missing"
    try:
        return decode(frame, codecs, expect_key=expect_key, out=out), None
    except FrameError as err:
        return None, str(err)
