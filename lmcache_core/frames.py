"""Frames for backend authors: build, parse and verify serde frames through two
classes, without learning the frame's layout.

A tier that stores bytes needs six names, all importable from here::

    from lmcache_core.frames import Codec, FrameError, FrameHeader, FrameReader, FrameWriter, Verdict

* :class:`FrameWriter` builds one chunk's frame: whole (:meth:`FrameWriter.to_bytes`),
  or as ``header + payload`` parts for vectored, positioned or streaming writes
  (:attr:`~FrameWriter.payload` is a zero-copy view of the tensor for the raw codec,
  :attr:`~FrameWriter.header_len` is known before the checksum is, and
  :meth:`~FrameWriter.header` may run while the payload is being written).
* :class:`FrameReader` reads frames for one tier (its codecs and its seal): a whole
  frame into the caller's tensor (:meth:`~FrameReader.decode`), or header first
  (:meth:`~FrameReader.check`), then the payload verified as it arrives
  (:meth:`~FrameReader.verifier`, a :class:`FrameVerifier`).
* :class:`FrameHeader` is a parsed header (key, codec, dtype, shape, lengths): what
  an index or a start-up scan needs, from a frame's first bytes alone.

Seals (``frame_secret``) and codecs are handled inside: a writer seals with the seal
its codec carries (``BackendContext.codec``), a reader checks the one its codecs
carry (``BackendContext.codecs``). The bytes are exactly :func:`serde.encode`'s, so
frames written through this module and through serde read the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .keys import ChunkKey
from .serde import (
    checksum_matches,
    DTYPE_NAMES,
    DTYPES,
    MAX_DECODE_RAW_BYTES,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    Codec,
    Decoded,
    ForeignFrame,
    FrameError,
    FrameInfo,
    FrameSeal,
    Hasher,
    UnknownCodec,
    Verdict,
    WrongShape,
    check_frame,
    check_seal,
    checksum_placeholder,
    codec_output,
    encode_payload,
    frame_codec,
    frame_header,
    frame_meta,
    header_span,
    parse_header_prefix,
    payload_checksum,
    payload_hasher,
    seal_of,
    tensor_bytes,
    try_decode,
    verify_payload,
)

__all__ = [
    "Codec",
    "Decoded",
    "ForeignFrame",
    "FrameError",
    "FrameHeader",
    "FrameReader",
    "FrameSeal",
    "FrameVerifier",
    "FrameWriter",
    "UnknownCodec",
    "Verdict",
    "WrongShape",
]

_NO_CODECS: Mapping[str, Codec] = {}


def _raw_bytes(data: bytes | bytearray | memoryview | torch.Tensor) -> bytes | bytearray | memoryview:
    return tensor_bytes(data) if isinstance(data, torch.Tensor) else data


class FrameWriter:
    """One chunk's frame, ready to be written.

    ``FrameWriter(key, tensor, codec)`` encodes the payload at once (sealed with
    ``seal``, or with the seal ``codec`` carries; a codec that cannot encode the
    tensor's dtype is replaced by the raw codec, as :func:`serde.encode` does) and
    computes the checksum only when :meth:`header` is called, so a writer can start
    moving :attr:`payload` first::

        w = FrameWriter(key, tensor, ctx.codec)
        store.put(name, w.to_bytes())                 # whole frame
        store.writev(name, [w.header(), w.payload])   # two parts, payload not copied

    ``header() + payload`` is byte for byte :meth:`to_bytes`. :attr:`header_len`
    does not depend on the checksum's value: reserve it, write the payload after
    it, then write :meth:`header` (or hash the payload yourself while writing it
    with :meth:`hasher` and finish with :meth:`header_with`).
    """

    __slots__ = ("codec", "seal", "meta", "raw_len", "payload", "header_len", "size", "zero_copy")

    def __init__(self, key: ChunkKey, tensor: torch.Tensor, codec: Codec, *, seal: FrameSeal | None = None) -> None:
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"dtype {tensor.dtype} cannot be framed")
        #: the seal the frame carries (None: unsealed)
        self.seal = seal if seal is not None else seal_of(codec)
        #: the codec the payload is written with (raw when ``codec`` cannot take the dtype)
        self.codec = frame_codec(tensor, codec)
        raw_len, payload = encode_payload(tensor, self.codec)
        #: the tensor's byte length; :attr:`payload`: the codec's output, ``size``: the frame's
        self.raw_len = raw_len
        self.payload: memoryview = payload
        #: the frame's metadata (no checksum), as the header will hold it
        self.meta = frame_meta(key, tensor, self.codec.name, raw_len, seal=self.seal)
        self.header_len = len(frame_header(self.meta, checksum_placeholder(self.meta), payload.nbytes))
        self.size = self.header_len + payload.nbytes
        #: the payload is ``tensor``'s own memory (raw codec, contiguous CPU tensor):
        #: valid while that memory is unchanged, and written without a copy
        self.zero_copy = (
            tensor.device.type == "cpu" and tensor.is_contiguous() and payload.nbytes == raw_len and self.codec.name == "raw"
        )

    def header(self) -> bytes:
        """The bytes before the payload, checksum (or MAC) included: hashes the payload."""
        return self.header_with(payload_checksum(self.meta, self.payload, self.seal))

    def hasher(self) -> Hasher:
        """A streaming hasher already fed the metadata: ``update`` it with the payload
        in order, then ``header_with(h.hexdigest())``."""
        return payload_hasher(self.meta, self.seal)

    def header_with(self, checksum: str) -> bytes:
        """The header for a payload whose checksum (from :meth:`hasher`) is known."""
        return frame_header(self.meta, checksum, self.payload.nbytes)

    def parts(self) -> tuple[bytes, memoryview]:
        """``(header, payload)``: the frame in two parts, the payload not copied."""
        return self.header(), self.payload

    def to_bytes(self) -> bytes:
        """The whole frame (one copy of the payload)."""
        header = self.header()
        out = bytearray(len(header) + self.payload.nbytes)
        out[: len(header)] = header
        out[len(header) :] = self.payload
        return bytes(out)

    @classmethod
    def encode(cls, key: ChunkKey, tensor: torch.Tensor, codec: Codec, *, seal: FrameSeal | None = None) -> bytes:
        """``FrameWriter(...).to_bytes()``: :func:`serde.encode`."""
        return cls(key, tensor, codec, seal=seal).to_bytes()

    @staticmethod
    def header_size(key: ChunkKey, tensor: torch.Tensor, *, seal: FrameSeal | None = None) -> int:
        """The header length of ``tensor``'s raw-codec frame under ``key`` (sealed with
        ``seal``), without encoding anything: for bounding a read before it moves a
        byte. Frames of other codecs differ by a few bytes (codec name, length
        digits)."""
        n = tensor.numel() * tensor.element_size()
        meta = frame_meta(key, tensor, "raw", n, seal=seal)
        return len(frame_header(meta, checksum_placeholder(meta), n))

    @staticmethod
    def seal_of(codec: object) -> FrameSeal | None:
        """The seal frames written with ``codec`` (or read with a codec mapping) carry."""
        return seal_of(codec)


@dataclass(frozen=True)
class FrameHeader(FrameInfo):
    """A parsed, validated frame header: the chunk's ``key`` (string form), ``codec``,
    ``dtype``, ``shape``, ``raw_len`` and ``payload_len`` (a :class:`serde.FrameInfo`),
    plus ``meta`` (the header's metadata; None for a header known only from its
    fields, say an index record) and ``offset`` (where the payload starts).

    Equality compares the fields only, not ``meta`` or ``offset``.
    """

    #: the dtype names a frame may hold, and their torch dtypes
    DTYPES: ClassVar[Mapping[str, torch.dtype]] = DTYPES

    meta: Mapping[str, str] | None = field(default=None, compare=False)
    offset: int = field(default=0, compare=False)

    @staticmethod
    def span(head: bytes | bytearray | memoryview) -> int:
        """From a frame's first 8 (or more) bytes, how many bytes precede its payload:
        read that much before :meth:`parse`. Raises :class:`FrameError`."""
        return header_span(head)

    @classmethod
    def parse(cls, head: bytes | bytearray | memoryview, total_len: int | None = None) -> FrameHeader:
        """Parse and validate the header at the start of ``head``, a frame of
        ``total_len`` bytes (default: ``head`` is the whole frame). ``head`` must
        hold at least :meth:`span` bytes. The lengths must add up to ``total_len``;
        nothing is checked against a key, a tensor, the codecs or the seal here
        (:meth:`FrameReader.check`), and the payload is not hashed. Raises
        :class:`FrameError`."""
        mv = memoryview(head).cast("B")
        info, meta, offset = parse_header_prefix(mv, mv.nbytes if total_len is None else total_len)
        return cls(info.key, info.codec, info.dtype, info.shape, info.raw_len, info.payload_len, meta, offset)

    @property
    def size(self) -> int:
        """The whole frame's length."""
        return self.offset + self.payload_len

    @property
    def sealed(self) -> bool:
        """Whether the frame is sealed (its checksum is a MAC)."""
        return self.meta is not None and "auth" in self.meta

    def payload(self, frame: bytes | bytearray | memoryview) -> memoryview:
        """The payload of ``frame`` (the frame this header was parsed from), a view."""
        return memoryview(frame).cast("B")[self.offset : self.offset + self.payload_len]


class FrameVerifier:
    """A payload's checksum (or MAC) computed as the payload arrives: ``update`` it
    with every piece in order, then :meth:`check` (raises) or :meth:`matches`."""

    __slots__ = ("_hasher", "_meta", "_sealed")

    def __init__(self, header: FrameHeader, seal: FrameSeal | None) -> None:
        if header.meta is None:
            raise ValueError("a header without metadata cannot verify a payload: parse the frame's own header")
        self._hasher = payload_hasher(header.meta, seal)  # raises ForeignFrame unless sealed as read
        self._meta = header.meta
        self._sealed = seal is not None

    def update(self, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Feed the next payload bytes (a CPU tensor counts as its bytes)."""
        self._hasher.update(_raw_bytes(data))

    def hexdigest(self) -> str:
        return str(self._hasher.hexdigest())

    def matches(self) -> bool:
        """Whether the bytes fed so far are the frame's payload."""
        return checksum_matches(self._meta, self.hexdigest())  # constant time

    def check(self) -> None:
        """Raise :class:`FrameError` unless :meth:`matches`."""
        if not self.matches():
            raise FrameError("MAC mismatch: not written with our frame_secret" if self._sealed else "checksum mismatch")


class FrameReader:
    """Reads frames as one tier: with its ``codecs`` (``BackendContext.codecs``) and
    seal (``seal``, or the one ``codecs`` carries). Cheap; make one per tier.

    Whole frames: :meth:`decode` (never raises; a :class:`serde.Decoded`: ``.tensor``,
    ``.reason``, ``.verdict``). Header first: :meth:`FrameHeader.parse`, then
    :meth:`check` (the key, the caller's tensor, the codec and the seal, before any
    payload work), then the payload through :meth:`verifier` as it arrives (or
    :meth:`verify` once it is all there) and :meth:`decode_unverified` into the
    caller's tensor.
    """

    #: a header is at most this long (after its 8-byte length prefix)
    MAX_HEADER_BYTES: ClassVar[int] = MAX_HEADER_BYTES
    #: a payload is at most this long
    MAX_PAYLOAD_BYTES: ClassVar[int] = MAX_PAYLOAD_BYTES
    #: no frame is longer
    MAX_FRAME_BYTES: ClassVar[int] = 8 + MAX_HEADER_BYTES + MAX_PAYLOAD_BYTES

    __slots__ = ("codecs", "seal")

    def __init__(self, codecs: Mapping[str, Codec] = _NO_CODECS, *, seal: FrameSeal | None = None) -> None:
        self.codecs = codecs
        self.seal = seal if seal is not None else seal_of(codecs)

    def decode(
        self,
        frame: bytes | bytearray | memoryview | None,
        *,
        key: ChunkKey | None = None,
        out: torch.Tensor | None = None,
        max_raw_bytes: int = MAX_DECODE_RAW_BYTES,
    ) -> Decoded:
        """Verify a whole frame and decode it into ``out`` (zero-copy for a raw frame
        into a contiguous CPU tensor); :func:`serde.try_decode`. ``.tensor`` for a hit,
        ``.reason`` for a miss; ``.verdict`` says which kind (MISSING when ``frame``
        is None)."""
        return try_decode(frame, self.codecs, expect_key=key, out=out, max_raw_bytes=max_raw_bytes, seal=self.seal)

    def check(
        self,
        header: FrameInfo,
        *,
        key: ChunkKey | None = None,
        out: torch.Tensor | None = None,
        max_raw_bytes: int = MAX_DECODE_RAW_BYTES,
    ) -> Codec:
        """Everything a header must pass before its payload is read: ``key``, the
        dtype and shape of ``out`` (or a raw size within ``max_raw_bytes``), an
        installed codec that can produce that size, then the seal (when the header
        carries its metadata; :meth:`verifier` always checks it). Returns the codec;
        raises the :class:`FrameError` whose ``verdict`` :meth:`decode` would report
        (``err.keep_if_intact`` for a frame another reader may want)."""
        codec = check_frame(header, self.codecs, expect_key=key, out=out, max_raw_bytes=max_raw_bytes)
        meta = getattr(header, "meta", None)
        if meta is not None:
            check_seal(meta, self.seal)
        return codec

    def verdict(
        self,
        head: bytes | bytearray | memoryview,
        total_len: int,
        *,
        key: ChunkKey | None = None,
        out: torch.Tensor | None = None,
    ) -> Verdict:
        """From a frame's first bytes alone: the verdict :meth:`decode` would give if
        the header is refused, or OK when it passes :meth:`check` (the payload is
        then unchecked: not a hit). For a value read only in part."""
        try:
            self.check(FrameHeader.parse(head, total_len), key=key, out=out)
        except FrameError as err:
            return err.verdict
        return Verdict.OK

    def verifier(self, header: FrameHeader) -> FrameVerifier:
        """A :class:`FrameVerifier` for ``header``'s payload (raises
        :class:`FrameError` when the frame is not sealed as this reader reads)."""
        return FrameVerifier(header, self.seal)

    def verify(self, header: FrameHeader, payload: bytes | bytearray | memoryview) -> None:
        """Raise :class:`FrameError` unless ``payload`` (all of it) is ``header``'s."""
        if header.meta is None:
            raise ValueError("a header without metadata cannot verify a payload: parse the frame's own header")
        verify_payload(header.meta, payload, self.seal)

    def decode_unverified(self, header: FrameInfo, payload: memoryview, out: torch.Tensor) -> torch.Tensor:
        """Decode ``payload`` into ``out`` after :meth:`check`, without hashing: the
        caller verifies (feed ``out`` or ``payload`` to a :meth:`verifier`) before
        serving ``out``. Raises :class:`FrameError`; returns ``out``."""
        codec = check_frame(header, self.codecs, out=out)
        return codec_output(codec, header, payload, out)

    @staticmethod
    def max_frame_len(out: torch.Tensor) -> int:
        """The largest frame that can decode into ``out`` with any codec shipped here
        (header, plus LZ4's worst case on incompressible data): bound a read with it."""
        return 8 + MAX_HEADER_BYTES + out.nbytes + out.nbytes // 255 + 64
