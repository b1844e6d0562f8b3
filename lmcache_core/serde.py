"""One self-describing frame per chunk, for every tier that stores bytes.

The container is safetensors' (so ``safetensors`` can open a frame for inspection):
an 8-byte little-endian header length, a JSON header, then the payload. Our fields
live in ``__metadata__``: format version, codec, dtype, shape, key, raw length, and a
checksum: XXH3-64 (``xxhash``) over the canonical metadata and then the payload, as
16 hex digits (format 2; format 1 used CRC32, several times slower than a memory
copy, and its frames are now misses like any unknown format).

A *sealed* frame (written with a deployment secret, see :class:`FrameSeal`) carries
one more field, ``auth`` (the key's public id, 16 hex digits), and its ``checksum``
is then a keyed BLAKE3 MAC (64 hex digits) over the same bytes: anyone without the
secret can no longer make a frame that a sealed reader accepts, so a store shared
with other clients cannot plant KV. A reader with a seal refuses unsealed frames and
frames sealed with another key; a reader without one refuses sealed frames (each a
miss with that reason). Tiers get the seal through the codecs in their
:class:`~lmcache_core.backend.BackendContext` (:class:`SealedCodec` /
:class:`SealedCodecs`), so :func:`encode` and :func:`try_decode` seal and check
without the tier doing anything; the pieces below take ``seal=`` explicitly.

Decoding is our own
strict parser: it never runs pickle, bounds every length before allocating, and
turns *any* inconsistency into :class:`FrameError` (a cache miss with a reason),
never into data. Each refusal carries a :class:`Verdict` (``err.verdict``, and
``try_decode(...).verdict``): the frame is *corrupt*, *foreign* (not this reader's to
serve), or of the *wrong shape* for the caller. Tiers act on the verdict (count a
corrupt value, keep one of another shape) instead of re-parsing the frame to guess.

Backend authors: :mod:`lmcache_core.frames` wraps all of this in
:class:`~lmcache_core.frames.FrameWriter` / :class:`~lmcache_core.frames.FrameReader`
(which build on this module; it never imports them); the functions below stay for
compatibility.

Tiers that hold whole frames use :func:`encode` / :func:`try_decode`. Tiers that move
header and payload separately (the disk tier writes and reads them with positioned
I/O, hashing the payload while the disk moves it) use the public pieces instead of
copying this module's layout: :func:`frame_meta`, :func:`frame_header`,
:func:`encode_parts` (or :func:`encode_payload`, which hands a :class:`TensorCodec`
such as the lossy ``fp8`` the tensor) to write; :func:`header_span`, :func:`parse_header_prefix`,
:func:`check_header`, :func:`payload_hasher` / :func:`verify_payload` to read.
"""

from __future__ import annotations

import enum
import hmac
import json
import logging
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

import blake3
import numpy as np
import torch
import xxhash

from .keys import ChunkKey

log = logging.getLogger(__name__)

FRAME_FORMAT = "lmcache-core/2"
MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 1 << 34
#: Default cap on the raw (decoded) size when :func:`decode` has no ``out`` tensor
#: to compare the header with; with ``out`` the raw size must equal ``out``'s.
MAX_DECODE_RAW_BYTES = 1 << 30
_MAX_INT = 1 << 62  # any length, offset or dimension above this is malformed
_DIGITS_RE = re.compile(r"[0-9]{1,19}")
_U64 = struct.Struct("<Q")
CHECKSUM_HEX_LEN = 16  # XXH3-64, lowercase hex
_CHECKSUM_RE = re.compile(r"[0-9a-f]{16}")
MAC_HEX_LEN = 64  # keyed BLAKE3-256, lowercase hex
_MAC_RE = re.compile(r"[0-9a-f]{64}")
_KEY_ID_RE = re.compile(r"[0-9a-f]{16}")
_META_FIELDS = frozenset({"format", "codec", "dtype", "shape", "key", "raw_len", "checksum"})
_SEALED_FIELDS = _META_FIELDS | {"auth"}
#: the shortest secret :class:`FrameSeal` accepts (bytes after UTF-8 encoding)
MIN_SECRET_BYTES = 16
_KDF_CONTEXT = "lmcache-core 2026-11-26 frame MAC key v1"

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
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}


class Verdict(enum.Enum):
    """What :func:`try_decode` concluded about a frame: a tier decides what to count,
    keep or delete from this, never from the wording of a reason."""

    #: decoded and verified: the caller's chunk
    OK = "ok"
    #: no frame at all (``try_decode(None, ...)``)
    MISSING = "missing"
    #: a well-formed header for the expected key whose dtype or shape is not the
    #: caller's (or, without ``out``, larger than ``max_raw_bytes``). Decided from the
    #: header's key, dtype and shape alone, before the seal, the codec or the checksum
    #: are looked at (the refusal costs no hashing): the stored value may be intact,
    #: and a tier that wants to keep it only if it is verifies it itself.
    WRONG_SHAPE = "wrong shape"
    #: damaged: checksum or MAC mismatch, truncated, a malformed header, lengths that
    #: disagree, a payload its codec cannot have produced
    CORRUPT = "corrupt"
    #: well formed but not this reader's: another frame format, a dtype or codec this
    #: build lacks, another key's frame, or sealed otherwise than this reader reads
    #: (with another key id, or sealed / unsealed when this reader is not / is)
    FOREIGN = "foreign"


class FrameError(Exception):
    """The bytes are not a valid frame for the expected chunk. Always a cache miss.

    ``verdict`` says which kind: :attr:`Verdict.CORRUPT` for this class, the others
    for the subclasses :class:`ForeignFrame`, :class:`UnknownCodec` and
    :class:`WrongShape`."""

    verdict: ClassVar[Verdict] = Verdict.CORRUPT
    #: a frame for the expected key that this reader cannot take but another may
    #: (another shape, a codec not installed here): worth keeping if it is intact
    keep_if_intact: ClassVar[bool] = False


class ForeignFrame(FrameError):
    """A well-formed frame that is not this reader's (see :attr:`Verdict.FOREIGN`)."""

    verdict = Verdict.FOREIGN


class UnknownCodec(ForeignFrame):
    """A frame for the expected key and shape, written with a codec not installed
    here. Foreign to this reader, but another process (one with the codec) may read
    it: a store shared with such processes keeps it if it is intact (the disk tier
    does)."""

    keep_if_intact = True


class WrongShape(FrameError):
    """A frame for the expected key of another dtype or shape than the caller's
    (see :attr:`Verdict.WRONG_SHAPE`)."""

    verdict = Verdict.WRONG_SHAPE
    keep_if_intact = True


class FrameSeal:
    """A deployment's frame key, from its secret (``frame_secret``): seals the frames
    it writes and checks the ones it reads (see the module docstring).

    The 32-byte MAC key is derived from the secret with BLAKE3's key derivation (a
    context string of our own), so the secret itself is never a hash key; ``key_id``
    (16 hex digits, derived one way from the key) names the key in frames and
    messages without revealing it. ``repr`` shows only the id.
    """

    __slots__ = ("_key", "key_id")

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(f"a frame secret needs at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
        self._key = blake3.blake3(raw, derive_key_context=_KDF_CONTEXT).digest()
        self.key_id: str = blake3.blake3(b"key id", key=self._key).hexdigest()[:16]

    def hasher(self) -> Any:
        """A fresh keyed BLAKE3 hasher (``update`` / ``hexdigest``)."""
        return blake3.blake3(key=self._key)

    def __repr__(self) -> str:
        return f"FrameSeal(key_id={self.key_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FrameSeal) and other.key_id == self.key_id

    def __hash__(self) -> int:
        return hash(self.key_id)


class Hasher(Protocol):
    """What :func:`payload_hasher` returns: XXH3-64 or keyed BLAKE3."""

    def update(self, data: bytes | bytearray | memoryview, /) -> Any: ...

    def hexdigest(self) -> str: ...


class Codec(Protocol):
    """A payload codec. ``decode`` gets the exact raw length from the (checksummed)
    header and must fail (raise) rather than return a different length.

    A codec may also declare ``max_ratio`` (an int): no payload of ``n`` bytes ever
    decodes to more than ``max_ratio * n + 64`` bytes. :func:`decode` then refuses a
    header that claims more before it allocates anything (see :func:`check_frame`).

    A codec may have ``prepare()``: the engine calls it once at start for each tier
    configured with the codec, so what the codec builds or loads (the ``fp8``
    kernel) is ready before the first request; it must not raise for what the codec
    can do without."""

    name: str

    def encode(self, raw: memoryview) -> bytes | memoryview: ...

    def decode(self, payload: memoryview, raw_len: int) -> bytes | memoryview: ...


class TensorCodec(Codec, Protocol):
    """The optional extension of :class:`Codec` for codecs that need the tensor's
    dtype and shape (a quantizer such as ``fp8``): a codec that has
    ``encode_tensor`` is given the tensor instead of its bytes, one that has
    ``decode_tensor`` is given the header's dtype and shape (both checksummed with
    the payload), so a frame decodes in any process with the codec installed.
    Byte codecs (``raw``, ``lz4``, third-party ones) lack both and work as before.

    ``decode_tensor`` returns a CPU tensor of exactly ``dtype`` and ``shape``
    (written into ``out`` when given, and then ``out`` itself) or raises on a
    payload it cannot have written; serde turns any exception into a
    :class:`FrameError` and checks the result's dtype and shape.

    ``lossy = True`` declares that a round trip does not give the same bits back:
    such a codec's frames satisfy only a tier configured with that very codec (see
    :func:`tier_codecs`), never a reader that expects exact KV. A lossy codec may
    declare ``error_bound`` (a float): the largest relative error
    ``||decoded - original|| / ||original||`` it can produce; the correctness
    canary accepts a copy from its tier within that bound (without it, the canary
    compares as for exact KV).

    ``accepts(dtype)``, when a codec has it, says which tensors it can encode: a
    chunk of another dtype is framed raw instead (see :func:`frame_codec`)."""

    lossy: bool

    def encode_tensor(self, tensor: torch.Tensor) -> bytes | memoryview: ...

    def decode_tensor(
        self, payload: memoryview, dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor | None
    ) -> torch.Tensor: ...


def is_lossy(codec: object) -> bool:
    """Whether ``codec`` declares ``lossy = True`` (byte codecs do not: lossless)."""
    return getattr(codec, "lossy", False) is True


class TierCodecs(dict[str, "Codec"]):
    """The codecs one tier may decode with (see :func:`tier_codecs`); ``refused``
    names the installed lossy codecs left out, for the miss's reason."""

    refused: frozenset[str] = frozenset()


def tier_codecs(codecs: Mapping[str, Codec], codec: Codec) -> dict[str, Codec]:
    """The codecs a tier that writes with ``codec`` reads with: every lossless one,
    plus ``codec`` itself when it is lossy. A frame written by any other lossy codec
    is then a miss (:class:`UnknownCodec`, verdict FOREIGN) for that tier: a tier
    configured lossless never serves approximate KV as a hit, whoever wrote the
    store. The sealing of ``codecs`` (:class:`SealedCodecs`) is kept."""
    keep = {n: c for n, c in codecs.items() if not is_lossy(c) or n == codec.name}
    refused = frozenset(codecs) - frozenset(keep)
    if isinstance(codecs, SealedCodecs):
        sealed = SealedCodecs(keep, codecs.seal)
        sealed.refused = refused
        return sealed
    plain = TierCodecs(keep)
    plain.refused = refused
    return plain


class RawCodec:
    name = "raw"
    max_ratio = 1

    def encode(self, raw: memoryview) -> memoryview:
        return raw

    def decode(self, payload: memoryview, raw_len: int) -> memoryview:
        return payload


class Lz4Codec:
    name = "lz4"
    max_ratio = 255  # LZ4 block format: one extra length byte per 255 bytes of match

    def encode(self, raw: memoryview) -> bytes:
        import lz4.block

        out: bytes = lz4.block.compress(raw, store_size=False)
        return out

    def decode(self, payload: memoryview, raw_len: int) -> bytes:
        import lz4.block

        out: bytes = lz4.block.decompress(payload, uncompressed_size=raw_len)
        return out


class SealedCodec:
    """``codec`` with a :class:`FrameSeal`: :func:`encode` / :func:`encode_parts`
    seal the frames they build with it. The engine hands tiers this (as
    ``BackendContext.codec``) when ``frame_secret`` is set."""

    def __init__(self, codec: Codec, seal: FrameSeal) -> None:
        self.inner = codec
        self.seal = seal
        self.name = codec.name
        ratio = getattr(codec, "max_ratio", None)
        if ratio is not None:
            self.max_ratio = ratio
        # the optional tensor-codec extension (:class:`TensorCodec`), forwarded only
        # when the codec has it, so serde treats the wrapper exactly as the codec
        for attr in ("lossy", "error_bound", "accepts", "encode_tensor", "decode_tensor", "prepare"):
            if hasattr(codec, attr):
                setattr(self, attr, getattr(codec, attr))

    def encode(self, raw: memoryview) -> bytes | memoryview:
        return self.inner.encode(raw)

    def decode(self, payload: memoryview, raw_len: int) -> bytes | memoryview:
        return self.inner.decode(payload, raw_len)


class SealedCodecs(dict[str, Codec]):
    """The installed codecs by name, each wrapped in a :class:`SealedCodec`:
    :func:`decode` / :func:`try_decode` given this mapping, or any copy of it (a
    tier's ``dict(ctx.codecs)`` keeps the wrapped codecs), accept only frames sealed
    with ``seal``. ``BackendContext.codecs`` when ``frame_secret`` is set."""

    def __init__(self, codecs: Mapping[str, Codec], seal: FrameSeal) -> None:
        super().__init__({name: SealedCodec(getattr(c, "inner", c), seal) for name, c in codecs.items()})
        self.seal = seal
        self.refused: frozenset[str] = frozenset()


def seal_of(codec_or_codecs: object) -> FrameSeal | None:
    """The seal a codec or a codec mapping carries (``None`` for plain ones). A
    mapping is sealed when it is a :class:`SealedCodecs` or holds a
    :class:`SealedCodec` (a plain copy of one)."""
    seal = getattr(codec_or_codecs, "seal", None)
    if isinstance(seal, FrameSeal):
        return seal
    if isinstance(codec_or_codecs, Mapping):
        for c in codec_or_codecs.values():
            if isinstance(c, SealedCodec):
                return c.seal
    return None


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
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def frame_meta(
    key: ChunkKey, tensor: torch.Tensor, codec_name: str, raw_len: int, *, seal: FrameSeal | None = None
) -> dict[str, str]:
    """The frame metadata of ``tensor`` under ``key``, without the ``checksum`` field.

    Public so that a tier which writes frames in parts (header and payload
    separately, see :func:`frame_header`) builds exactly the metadata :func:`encode`
    would. ``raw_len`` is the tensor's byte length before the codec. With ``seal``
    the metadata names its key (``auth``): the frame's checksum is then a MAC.
    """
    if tensor.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {tensor.dtype} cannot be framed")
    meta = {
        "format": FRAME_FORMAT,
        "codec": codec_name,
        "dtype": DTYPE_NAMES[tensor.dtype],
        "shape": json.dumps(list(tensor.shape)),
        "key": key.to_str(),
        "raw_len": str(raw_len),
    }
    if seal is not None:
        meta["auth"] = seal.key_id
    return meta


def check_seal(meta: Mapping[str, str], seal: FrameSeal | None) -> None:
    """Raise :class:`ForeignFrame` unless ``meta`` is sealed exactly when ``seal`` is
    given, and with ``seal``'s key: a reader with a secret takes no unsealed frame
    (anyone could have written it), a reader without one cannot check a sealed one."""
    auth = meta.get("auth")
    if seal is None:
        if auth is not None:
            raise ForeignFrame(f"frame is sealed (key id {auth}); this reader has no frame_secret")
    elif auth is None:
        raise ForeignFrame("frame is not sealed: written without frame_secret (or planted), refused")
    elif not (isinstance(auth, str) and hmac.compare_digest(auth.encode("utf-8", "surrogatepass"), seal.key_id.encode())):
        raise ForeignFrame(f"frame is sealed with another key (id {auth}, ours {seal.key_id})")


def checksum_matches(meta: Mapping[str, str], digest: str) -> bool:
    """Whether ``digest`` (a :func:`payload_hasher`'s ``hexdigest()``) is ``meta``'s
    ``checksum`` field, compared with :func:`hmac.compare_digest`: in a time that does
    not depend on how many leading digits agree, so whoever can time reads learns
    nothing about the MAC a forged frame would need. Every tier compares with this,
    never ``==``. A missing or non-text field is no match."""
    stored = meta.get("checksum")
    if not isinstance(stored, str):
        return False
    # bytes: compare_digest takes str only when ASCII, and a planted header need not be
    return hmac.compare_digest(digest.encode("utf-8", "surrogatepass"), stored.encode("utf-8", "surrogatepass"))


def checksum_placeholder(meta: Mapping[str, str]) -> str:
    """A checksum of the right length for ``meta`` (zeros): a writer reserves the
    header's room with ``frame_header(meta, checksum_placeholder(meta), n)``."""
    return "0" * (MAC_HEX_LEN if "auth" in meta else CHECKSUM_HEX_LEN)


def payload_hasher(meta: Mapping[str, str], seal: FrameSeal | None = None) -> Hasher:
    """A streaming XXH3-64 hasher (keyed BLAKE3 for a sealed frame) already fed the
    frame's canonical metadata.

    The checksum covers the metadata (every field but ``checksum``, as sorted compact
    JSON, preceded by its length) and then the payload, so a header edited to claim
    another dtype, shape, codec or key fails as surely as a flipped payload byte.
    Tiers that move the payload in pieces (the disk tier reads it in segments) feed
    each piece to ``.update(chunk)`` as it arrives and, at the end, compare
    ``.hexdigest()`` with ``meta["checksum"]`` (16 lowercase hex digits, 64 when
    sealed) through :func:`checksum_matches`; unequal means the frame is corrupt or forged (a :class:`FrameError`,
    i.e. a miss). ``meta`` may or may not hold the ``checksum`` field; it is left out
    either way. ``seal`` must match the frame (:func:`check_seal`, raised here).
    """
    check_seal(meta, seal)
    canon = json.dumps({k: v for k, v in sorted(meta.items()) if k != "checksum"}, separators=(",", ":")).encode()
    h: Hasher = xxhash.xxh3_64() if seal is None else seal.hasher()
    h.update(_U64.pack(len(canon)))
    h.update(canon)
    return h


def payload_checksum(meta: Mapping[str, str], payload: bytes | bytearray | memoryview, seal: FrameSeal | None = None) -> str:
    """The ``checksum`` field value for ``payload`` under ``meta`` (16 hex digits;
    a 64-digit MAC when sealed)."""
    h = payload_hasher(meta, seal)
    h.update(payload)
    return str(h.hexdigest())


def verify_payload(meta: Mapping[str, str], payload: bytes | bytearray | memoryview, seal: FrameSeal | None = None) -> None:
    """Raise :class:`FrameError` unless ``payload`` matches ``meta["checksum"]``
    (and the frame is sealed with ``seal``, or unsealed without one).

    ``meta`` is the metadata returned by :func:`parse_header` or
    :func:`parse_header_prefix`; use this when the whole payload is in memory and
    :func:`payload_hasher` when it arrives in pieces."""
    if not checksum_matches(meta, payload_checksum(meta, payload, seal)):
        raise FrameError("MAC mismatch: not written with our frame_secret" if seal is not None else "checksum mismatch")


def frame_header(meta: Mapping[str, str], checksum: str, payload_len: int) -> bytes:
    """The bytes that precede the payload in a frame: the 8-byte little-endian header
    length, then the JSON header padded with spaces to a multiple of 8.

    ``meta`` comes from :func:`frame_meta`, ``checksum`` from :func:`payload_checksum`
    or :func:`payload_hasher`. Its length does not depend on the checksum's value
    (16 hex digits, 64 for a sealed frame), so a writer can reserve the header's room
    with ``len(frame_header(meta, checksum_placeholder(meta), n))``, write the
    payload after it, and hash the payload meanwhile. ``frame_header(...) + payload``
    is exactly :func:`encode`'s frame.
    """
    sealed = "auth" in meta
    if not (_MAC_RE if sealed else _CHECKSUM_RE).fullmatch(checksum):
        want = MAC_HEX_LEN if sealed else CHECKSUM_HEX_LEN
        raise ValueError(f"checksum must be {want} lowercase hex digits, got {checksum!r}")
    full = {k: v for k, v in meta.items() if k != "checksum"}
    full["checksum"] = checksum
    header = json.dumps(
        {"__metadata__": full, "payload": {"dtype": "U8", "shape": [payload_len], "data_offsets": [0, payload_len]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    return _U64.pack(len(header)) + header


RAW: Codec = RawCodec()
RAW_FALLBACK: set[tuple[str, str]] = set()
"""(codec, dtype) pairs :func:`frame_codec` framed raw so far in this process (each said once in the log)."""


def frame_codec(tensor: torch.Tensor, codec: Codec) -> Codec:
    """The codec a frame of ``tensor`` is written with: ``codec``, or the raw codec
    when ``codec`` declares (``accepts``) that it cannot encode ``tensor``'s dtype.
    That is fp8 and the byte pages of the grouped layouts (hybrid and
    sliding-window models, whose chunks are ``uint8`` pages): such a tier keeps
    caching, at full size, and the log says so once per codec and dtype. A raw
    frame is lossless, so any tier may serve it."""
    accepts = getattr(codec, "accepts", None)
    if accepts is None or accepts(tensor.dtype):
        return codec
    said = (codec.name, str(tensor.dtype).removeprefix("torch."))
    if said not in RAW_FALLBACK:
        RAW_FALLBACK.add(said)
        log.warning(
            "serde %s cannot encode %s chunks (byte pages of a hybrid or sliding-window model's cache): "
            "a tier set to %s stores them raw, at full size",
            said[0],
            said[1],
            said[0],
        )
    return RAW


def encode_parts(key: ChunkKey, tensor: torch.Tensor, codec: Codec, *, seal: FrameSeal | None = None) -> tuple[bytes, memoryview]:
    """A frame as ``(header, payload)`` with ``header + payload == encode(...)`` byte
    for byte, without building the concatenation. Sealed with ``seal``, or with the
    seal ``codec`` carries (:class:`SealedCodec`).

    For tiers that write the two parts separately (vectored or positioned writes):
    it saves :func:`encode`'s copies of the payload. With :class:`RawCodec` the
    payload is a zero-copy view of ``tensor``'s memory (of ``tensor.contiguous()``
    when it is not contiguous), valid while that memory is unchanged.
    """
    if tensor.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {tensor.dtype} cannot be framed")
    seal = seal if seal is not None else seal_of(codec)
    codec = frame_codec(tensor, codec)
    raw_len, payload = encode_payload(tensor, codec)
    meta = frame_meta(key, tensor, codec.name, raw_len, seal=seal)
    return frame_header(meta, payload_checksum(meta, payload, seal), payload.nbytes), payload


def encode_payload(tensor: torch.Tensor, codec: Codec) -> tuple[int, memoryview]:
    """``(raw_len, payload)``: the tensor's byte length (the header's ``raw_len``)
    and ``codec``'s payload for it. A :class:`TensorCodec` gets the tensor (its
    dtype and shape), a byte codec its bytes. For tiers that build frames from the
    pieces (:func:`frame_meta`, :func:`frame_header`) instead of
    :func:`encode_parts`."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    encode_tensor = getattr(codec, "encode_tensor", None)
    if encode_tensor is not None:
        return tensor.numel() * tensor.element_size(), memoryview(encode_tensor(tensor)).cast("B")
    raw = tensor_bytes(tensor)
    return raw.nbytes, memoryview(codec.encode(raw)).cast("B")


def encode(key: ChunkKey, tensor: torch.Tensor, codec: Codec, *, seal: FrameSeal | None = None) -> bytes:
    """Serialize one chunk into a frame (sealed as :func:`encode_parts` says)."""
    header, payload = encode_parts(key, tensor, codec, seal=seal)
    out = bytearray(len(header) + payload.nbytes)
    out[: len(header)] = header
    out[len(header) :] = payload
    return bytes(out)


def header_span(head: bytes | bytearray | memoryview) -> int:
    """From at least the first 8 bytes of a frame, the number of bytes from its start
    to its payload (``8 + header length``), so a reader knows how much to read before
    :func:`parse_header_prefix`. Raises :class:`FrameError` when fewer than 8 bytes
    are given or the header length exceeds :data:`MAX_HEADER_BYTES`."""
    mv = memoryview(head).cast("B")
    if mv.nbytes < 8:
        raise FrameError("truncated: shorter than the length prefix")
    hlen = int(_U64.unpack_from(mv, 0)[0])
    if hlen > MAX_HEADER_BYTES:
        raise FrameError(f"bad header length {hlen}")
    return 8 + hlen


def parse_header_prefix(head: bytes | bytearray | memoryview, total_len: int) -> tuple[FrameInfo, dict[str, str], int]:
    """Validate a frame's header from its first bytes and the frame's total length
    (say, a file's size), without the payload in memory.

    ``head`` must hold at least :func:`header_span` bytes (more is ignored). The
    checks are exactly :func:`parse_header`'s, lengths included: a header whose
    lengths do not add up to ``total_len`` is a :class:`FrameError`. Returns the
    info, the metadata and the payload offset; the payload (``total_len - offset``
    bytes) is then checked with :func:`payload_hasher` or :func:`verify_payload`.
    """
    mv = memoryview(head).cast("B")
    span = header_span(mv)
    if span > total_len:
        raise FrameError(f"bad header length {span - 8}")
    if span > mv.nbytes:
        raise FrameError(f"header is {span} bytes, only {mv.nbytes} given")
    info, meta = _parse_header_json(mv[8:span], total_len - span)
    return info, meta, span


def parse_header(frame: bytes | bytearray | memoryview) -> tuple[FrameInfo, dict[str, str], memoryview]:
    """Validate the header; return its info, the raw metadata and the payload view.
    The payload is not checked against the checksum here (see :func:`decode`,
    :func:`verify_payload`)."""
    mv = memoryview(frame).cast("B")
    span = header_span(mv)
    if span > mv.nbytes:
        raise FrameError(f"bad header length {span - 8}")
    info, meta = _parse_header_json(mv[8:span], mv.nbytes - span)
    return info, meta, mv[span:]


def _parse_header_json(text: memoryview, have_payload: int) -> tuple[FrameInfo, dict[str, str]]:
    """The checks shared by the header parsers; ``have_payload`` is the number of
    bytes that follow the header."""
    try:
        header = json.loads(bytes(text))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FrameError("header is not valid JSON") from None
    if not isinstance(header, dict) or set(header) != {"__metadata__", "payload"}:
        raise FrameError("header has the wrong fields")
    meta, entry = header["__metadata__"], header["payload"]
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FrameError("metadata is malformed")
    sealed = "auth" in meta
    if set(meta) != (_SEALED_FIELDS if sealed else _META_FIELDS):
        raise FrameError("metadata has the wrong fields")
    if meta["format"] != FRAME_FORMAT:
        raise ForeignFrame(f"unknown frame format {meta['format']!r}")
    if meta["dtype"] not in DTYPES:
        raise ForeignFrame(f"unknown dtype {meta['dtype']!r}")
    if sealed and not _KEY_ID_RE.fullmatch(meta["auth"]):
        raise FrameError("auth field is malformed")
    if not (_MAC_RE if sealed else _CHECKSUM_RE).fullmatch(meta["checksum"]):
        raise FrameError("checksum field is malformed")
    try:
        shape_doc = json.loads(meta["shape"])
    except (ValueError, RecursionError):
        raise FrameError("metadata values are malformed: shape is not JSON") from None
    if not isinstance(shape_doc, list):  # its length is bounded by MAX_HEADER_BYTES
        raise FrameError("metadata values are malformed: shape is not a list of sizes")
    shape = tuple(_bounded_int(d, "shape") for d in shape_doc)
    if not _DIGITS_RE.fullmatch(meta["raw_len"]):
        raise FrameError("metadata values are malformed: raw_len is not a decimal byte count")
    raw_len = int(meta["raw_len"])
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or entry.get("dtype") != "U8" or not (isinstance(offsets, list) and len(offsets) == 2):
        raise FrameError("metadata values are malformed: payload entry")
    lo, hi = _bounded_int(offsets[0], "data_offsets"), _bounded_int(offsets[1], "data_offsets")
    payload_len = hi - lo
    if lo != 0 or payload_len < 0 or payload_len > MAX_PAYLOAD_BYTES or entry.get("shape") != [payload_len]:
        raise FrameError("bad payload offsets")
    if payload_len != have_payload:
        raise FrameError(f"length mismatch: header says {payload_len} payload bytes, frame has {have_payload}")
    numel = 0 if 0 in shape else 1
    for d in shape if numel else ():  # stop once the product is absurd: no huge multiplications
        numel *= d
        if numel > MAX_PAYLOAD_BYTES:
            break
    if raw_len > MAX_PAYLOAD_BYTES or numel * _ITEMSIZE[meta["dtype"]] != raw_len:
        raise FrameError("shape, dtype and raw length disagree")
    info = FrameInfo(meta["key"], meta["codec"], meta["dtype"], shape, raw_len, payload_len)
    return info, meta


def _bounded_int(value: object, field: str) -> int:
    """A JSON number from a header as a non-negative int below 2**62: ``Infinity``,
    ``NaN``, floats, booleans, negatives and huge integers are malformed (a miss),
    never an ``OverflowError`` or a giant allocation."""
    if type(value) is not int or not 0 <= value < _MAX_INT:
        raise FrameError(f"metadata values are malformed: {field} holds {str(value)[:40]!r}")
    return value


def check_frame(
    info: FrameInfo,
    codecs: Mapping[str, Codec],
    *,
    expect_key: ChunkKey | None = None,
    out: torch.Tensor | None = None,
    max_raw_bytes: int = MAX_DECODE_RAW_BYTES,
) -> Codec:
    """Everything a header must satisfy before any payload work: the key, the dtype
    and shape ``out`` expects (so a frame never decodes into more memory than the
    caller's chunk), a raw size no larger than ``max_raw_bytes`` when there is no
    ``out``, an installed codec, and a raw size no larger than the codec can produce
    from the payload (a decompression bomb is refused here, before a single byte is
    allocated or decompressed). Returns the codec; raises :class:`FrameError`.

    The checks run in that order, which is the :class:`Verdict`'s precedence: another
    key's frame is :class:`ForeignFrame`, then another shape is :class:`WrongShape`
    whatever else is wrong with the frame, then a missing codec :class:`UnknownCodec`.
    Every tier's reads go through it via :func:`decode` or :func:`check_header`; the
    peer tier's shared-memory reads call it directly."""
    if expect_key is not None and info.key != expect_key.to_str():
        raise ForeignFrame(f"key mismatch: frame holds {info.key}")
    if out is not None:
        if DTYPES[info.dtype] != out.dtype or info.shape != tuple(out.shape):
            raise WrongShape(
                f"frame holds {info.dtype}{list(info.shape)}, caller expects "
                f"{DTYPE_NAMES.get(out.dtype, out.dtype)}{list(out.shape)}"
            )
    elif info.raw_len > max_raw_bytes:
        raise WrongShape(f"frame declares {info.raw_len} raw bytes, more than the {max_raw_bytes} allowed")
    codec = codecs.get(info.codec)
    if codec is None:
        if info.codec in getattr(codecs, "refused", ()):
            raise UnknownCodec(f"codec {info.codec!r} is lossy and this tier reads exact KV only (its serde differs)")
        raise UnknownCodec(f"codec {info.codec!r} is not installed")
    ratio = getattr(codec, "max_ratio", None)
    if isinstance(ratio, int) and info.raw_len > ratio * info.payload_len + 64:
        raise FrameError(
            f"frame declares {info.raw_len} raw bytes from a {info.payload_len}-byte {info.codec} payload "
            f"(at most {ratio}x): not a frame this codec wrote"
        )
    return codec


def check_header(
    info: FrameInfo,
    meta: Mapping[str, str],
    codecs: Mapping[str, Codec],
    *,
    expect_key: ChunkKey | None = None,
    out: torch.Tensor | None = None,
    max_raw_bytes: int = MAX_DECODE_RAW_BYTES,
    seal: FrameSeal | None = None,
) -> Codec:
    """Every check a parsed header (from :func:`parse_header` or
    :func:`parse_header_prefix`) must pass before its payload is read:
    :func:`check_frame`, then the seal (``seal``, or the one ``codecs`` carries;
    :func:`check_seal`). Returns the codec; raises the :class:`FrameError` whose
    ``verdict`` :func:`try_decode` would report. For tiers that read the header apart
    from the payload (the disk tier)."""
    codec = check_frame(info, codecs, expect_key=expect_key, out=out, max_raw_bytes=max_raw_bytes)
    check_seal(meta, seal if seal is not None else seal_of(codecs))
    return codec


def header_verdict(
    head: bytes | bytearray | memoryview,
    total_len: int,
    codecs: Mapping[str, Codec],
    *,
    expect_key: ChunkKey | None = None,
    out: torch.Tensor | None = None,
    max_raw_bytes: int = MAX_DECODE_RAW_BYTES,
    seal: FrameSeal | None = None,
) -> Verdict:
    """The verdict on a frame of ``total_len`` bytes from its first bytes (``head``)
    alone: what :func:`try_decode` would answer for a frame refused before its
    payload (CORRUPT, FOREIGN or WRONG_SHAPE), or OK when the header passes every
    check (its payload is then unchecked: OK here is not a hit). For a tier that read
    only a bounded prefix of a value (the Redis tier, for a value longer than any
    frame for the caller's chunk)."""
    try:
        info, meta, _ = parse_header_prefix(head, total_len)
        check_header(info, meta, codecs, expect_key=expect_key, out=out, max_raw_bytes=max_raw_bytes, seal=seal)
    except FrameError as err:
        return err.verdict
    return Verdict.OK


def decode(
    frame: bytes | bytearray | memoryview,
    codecs: Mapping[str, Codec],
    *,
    expect_key: ChunkKey | None = None,
    out: torch.Tensor | None = None,
    max_raw_bytes: int = MAX_DECODE_RAW_BYTES,
    seal: FrameSeal | None = None,
) -> torch.Tensor:
    """Decode and verify a frame. With ``out``, the data is written into it (its
    dtype and shape must match the frame) and ``out`` is returned; without it the
    raw size is capped at ``max_raw_bytes``. The header is checked against all of
    that and the seal (``seal``, or the one ``codecs`` carries: :class:`SealedCodecs`)
    by :func:`check_header` before the payload is hashed or decompressed. Raises
    :class:`FrameError` (its ``verdict`` says which kind of miss)."""
    seal = seal if seal is not None else seal_of(codecs)
    info, meta, payload = parse_header(frame)
    codec = check_header(info, meta, codecs, expect_key=expect_key, out=out, max_raw_bytes=max_raw_bytes, seal=seal)
    verify_payload(meta, payload, seal)
    if out is not None:
        return codec_output(codec, info, payload, out)
    if getattr(codec, "decode_tensor", None) is not None:
        return _tensor_decode(codec, info, payload, None)
    raw = _codec_decode(codec, info, payload)
    dtype = DTYPES[info.dtype]
    if info.raw_len == 0:  # torch cannot reinterpret an empty byte view
        return torch.empty(info.shape, dtype=dtype)
    arr = np.frombuffer(raw, dtype=np.uint8).copy()
    return torch.from_numpy(arr).view(dtype).reshape(info.shape)


def _codec_decode(codec: Codec, info: FrameInfo, payload: memoryview) -> bytes | memoryview:
    try:
        raw = codec.decode(payload, info.raw_len)
    except Exception as err:  # a codec library error on bad bytes is a miss
        raise FrameError(f"codec {info.codec} failed: {err}") from None
    raw_len = raw.nbytes if isinstance(raw, memoryview) else len(raw)
    if raw_len != info.raw_len:
        raise FrameError("decoded length differs from the header")
    return raw


def _tensor_decode(codec: Codec, info: FrameInfo, payload: memoryview, out: torch.Tensor | None) -> torch.Tensor:
    """A :class:`TensorCodec`'s decode, held to the header: any exception, and any
    result of another dtype or shape than the header's, is a :class:`FrameError`."""
    dtype = DTYPES[info.dtype]
    try:
        got = cast(TensorCodec, codec).decode_tensor(payload, dtype, info.shape, out)
    except Exception as err:  # a crafted payload is a miss, never a crash
        raise FrameError(f"codec {info.codec} failed: {err}") from None
    if not isinstance(got, torch.Tensor) or got.dtype != dtype or tuple(got.shape) != info.shape:
        raise FrameError(f"codec {info.codec} decoded another dtype or shape than the header's")
    if out is not None and got is not out:
        return copy_into(out, got)
    return got


def copy_into(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out.copy_(src)`` from any thread: ``out`` may be an inference tensor (made
    under ``torch.inference_mode``, as vLLM's KV cache and the pool views made under
    it are), which torch lets only code in inference mode write, and tiers decode on
    their own threads, outside it."""
    with torch.inference_mode(out.is_inference()):
        return out.copy_(src)


def codec_output(codec: Codec, info: FrameInfo, payload: memoryview, out: torch.Tensor) -> torch.Tensor:
    """Decode ``payload`` with ``codec`` straight into ``out`` (already checked against
    ``info`` by :func:`check_frame`); returns ``out``. No checksum here: a caller
    that skips :func:`verify_payload` must know the bytes are the ones verified
    earlier (the peer tier's shared-memory path, whose arena only the node writes)."""
    if getattr(codec, "decode_tensor", None) is not None:
        return _tensor_decode(codec, info, payload, out)
    raw = _codec_decode(codec, info, payload)
    if info.raw_len == 0:
        return out
    if out.is_contiguous() and out.device.type == "cpu":
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
    else:
        copy_into(out, torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(DTYPES[info.dtype]).reshape(info.shape))
    return out


@dataclass(frozen=True)
class Decoded:
    """:func:`try_decode`'s answer: ``tensor`` for a hit (``reason`` None), else
    ``reason`` for the miss (``tensor`` None); ``verdict`` names the kind of answer
    (:class:`Verdict`)."""

    tensor: torch.Tensor | None
    reason: str | None
    verdict: Verdict

    @property
    def ok(self) -> bool:
        """A hit: the frame decoded and verified."""
        return self.verdict is Verdict.OK

    def __repr__(self) -> str:
        return f"Decoded({self.verdict.name}, reason={self.reason!r})"


def try_decode(
    frame: bytes | bytearray | memoryview | None,
    codecs: Mapping[str, Codec],
    *,
    expect_key: ChunkKey | None = None,
    out: torch.Tensor | None = None,
    max_raw_bytes: int = MAX_DECODE_RAW_BYTES,
    seal: FrameSeal | None = None,
) -> Decoded:
    """:func:`decode` that answers instead of raising: a :class:`Decoded` (the tensor,
    or the reason for the miss, and the :class:`Verdict`; ``MISSING`` when ``frame``
    is None)."""
    if frame is None:
        return Decoded(None, "missing", Verdict.MISSING)
    try:
        tensor = decode(frame, codecs, expect_key=expect_key, out=out, max_raw_bytes=max_raw_bytes, seal=seal)
    except FrameError as err:
        return Decoded(None, str(err), err.verdict)
    return Decoded(tensor, None, Verdict.OK)
