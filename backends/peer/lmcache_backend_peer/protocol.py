"""The peer wire format: versioned, length-prefixed binary messages.

Every message is a fixed 20-byte header followed by a body::

    magic "LMCP" | version u8 | type u8 | flags u16 (0) | request id u32 | body length u64

(big-endian). The body length is checked against a maximum *before* anything is
allocated, and each message type has one exact body layout. Keys travel as 32 raw
bytes (namespace id + prefix hash); chunk data travels as serde frames, which carry
their own checksum and key, so the receiver can reject corrupt or misrouted data.

This module only turns bytes into values and back. Everything it rejects raises
:class:`ProtocolError` and nothing else, whatever the input (the decoder is fuzzed).
No pickle, no eval, no untrusted lengths used before they are bounded.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Sequence, Union

from lmcache_core.backend import BackendError
from lmcache_core.keys import HASH_BYTES, ChunkKey

MAGIC = b"LMCP"
VERSION = 1
HEADER = struct.Struct(">4sBBHIQ")
HEADER_SIZE = HEADER.size
KEY_SIZE = 2 * HASH_BYTES
NONCE_SIZE = 32
MAC_SIZE = 32
SERVER_ID_SIZE = 16
MAX_KEYS_PER_MESSAGE = 16384
MAX_EVICTIONS_PER_REPLY = 4096
MAX_ERROR_TEXT = 1024
MAX_TENANT_NAME = 64
TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

# Message types. Handshake first, then requests (even) and their replies (odd).
CHALLENGE = 1
AUTH = 2
AUTH_OK = 3
AUTH_TENANT = 4
LOOKUP = 10
LOOKUP_OK = 11
GET = 12
GET_OK = 13
PUT = 14
PUT_OK = 15
REMOVE = 16
REMOVE_OK = 17
SHM_ATTACH = 18
SHM_OK = 19
LOCATE = 20
LOCATE_OK = 21
EVICTIONS = 22
EVICTIONS_OK = 23
ERROR = 127

TYPE_NAMES = {
    CHALLENGE: "CHALLENGE",
    AUTH: "AUTH",
    AUTH_OK: "AUTH_OK",
    AUTH_TENANT: "AUTH_TENANT",
    LOOKUP: "LOOKUP",
    LOOKUP_OK: "LOOKUP_OK",
    GET: "GET",
    GET_OK: "GET_OK",
    PUT: "PUT",
    PUT_OK: "PUT_OK",
    REMOVE: "REMOVE",
    REMOVE_OK: "REMOVE_OK",
    SHM_ATTACH: "SHM_ATTACH",
    SHM_OK: "SHM_OK",
    LOCATE: "LOCATE",
    LOCATE_OK: "LOCATE_OK",
    EVICTIONS: "EVICTIONS",
    EVICTIONS_OK: "EVICTIONS_OK",
    ERROR: "ERROR",
}

Buffer = Union[bytes, bytearray, memoryview]


class PeerError(BackendError):
    """Anything that went wrong talking to a peer; always a cache miss."""


class ProtocolError(PeerError):
    """Bytes that are not a valid message (bad magic, version, type, length, body)."""


@dataclass(frozen=True)
class Header:
    type: int
    request_id: int
    body_len: int


@dataclass(frozen=True)
class Challenge:
    nonce: bytes
    server_id: bytes


@dataclass(frozen=True)
class Auth:
    nonce: bytes
    mac: bytes


@dataclass(frozen=True)
class AuthTenant:
    """AUTH as a named tenant: the proof is made with that tenant's own secret."""

    nonce: bytes
    mac: bytes
    tenant: str


@dataclass(frozen=True)
class AuthOk:
    mac: bytes


@dataclass(frozen=True)
class KeysRequest:
    """LOOKUP, GET and REMOVE all carry a batch of keys."""

    keys: list[ChunkKey]


@dataclass(frozen=True)
class Count:
    """LOOKUP_OK (prefix count) and REMOVE_OK (keys removed)."""

    n: int


@dataclass(frozen=True)
class GetReply:
    """One entry per answered key, in request order; None is a miss. It may answer
    fewer keys than asked (the reply hit the frame size limit): ask again for the rest."""

    frames: list[memoryview | None]


@dataclass(frozen=True)
class PutRequest:
    key: ChunkKey
    frame: memoryview


@dataclass(frozen=True)
class PutReply:
    stored: bool


@dataclass(frozen=True)
class ShmAttach:
    """Ask for this principal's arena (Unix socket only; the fd comes with SHM_OK)."""


@dataclass(frozen=True)
class ShmOk:
    size: int


@dataclass(frozen=True)
class LocateReply:
    """Per key ``(offset, frame length, generation)`` in the arena; length 0: not held."""

    entries: list[tuple[int, int, int]]


@dataclass(frozen=True)
class EvictionsRequest:
    """EVICTIONS: this principal's drops numbered ``since`` and later (added after
    version 1 shipped: a node that predates it closes the connection on it)."""

    since: int


@dataclass(frozen=True)
class EvictionsReply:
    """EVICTIONS_OK: ``keys`` are the drops numbered ``first``, ``first + 1``, ...;
    ``head`` is the number the node's next drop gets."""

    first: int
    head: int
    keys: list[ChunkKey]


@dataclass(frozen=True)
class ErrorReply:
    message: str


Body = Union[
    Challenge,
    Auth,
    AuthTenant,
    AuthOk,
    KeysRequest,
    Count,
    GetReply,
    PutRequest,
    PutReply,
    ShmAttach,
    ShmOk,
    LocateReply,
    EvictionsRequest,
    EvictionsReply,
    ErrorReply,
]


# -- header ---------------------------------------------------------------------------
def pack_header(mtype: int, request_id: int, body_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, mtype, 0, request_id & 0xFFFFFFFF, body_len)


def decode_header(data: Buffer, max_body: int) -> Header:
    """Parse and bound a header; ``max_body`` is the largest body this side accepts."""
    mv = memoryview(data).cast("B")
    if mv.nbytes != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {mv.nbytes}")
    magic, version, mtype, flags, rid, body_len = HEADER.unpack(mv)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not an lmcache peer speaking to us")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (we speak {VERSION})")
    if mtype not in TYPE_NAMES:
        raise ProtocolError(f"unknown message type {mtype}")
    if flags != 0:
        raise ProtocolError(f"unknown flags {flags:#x}")
    if body_len > max_body:
        raise ProtocolError(f"{TYPE_NAMES[mtype]} body of {body_len} bytes exceeds the limit of {max_body}")
    return Header(mtype, rid, body_len)


# -- bodies -----------------------------------------------------------------------------
def _exact(body: memoryview, size: int, what: str) -> None:
    if body.nbytes != size:
        raise ProtocolError(f"{what} body must be {size} bytes, got {body.nbytes}")


def _key_at(body: memoryview, off: int) -> ChunkKey:
    return ChunkKey(bytes(body[off : off + HASH_BYTES]), bytes(body[off + HASH_BYTES : off + KEY_SIZE]))


def key_bytes(key: ChunkKey) -> bytes:
    return key.namespace + key.chunk_hash


def encode_keys(keys: Sequence[ChunkKey]) -> bytes:
    if len(keys) > MAX_KEYS_PER_MESSAGE:
        raise ValueError(f"at most {MAX_KEYS_PER_MESSAGE} keys per message")
    return _U32.pack(len(keys)) + b"".join(key_bytes(k) for k in keys)


def _decode_keys(body: memoryview, what: str) -> KeysRequest:
    if body.nbytes < 4:
        raise ProtocolError(f"{what} body is truncated")
    (n,) = _U32.unpack_from(body, 0)
    if n > MAX_KEYS_PER_MESSAGE:
        raise ProtocolError(f"{what} asks for {n} keys, more than {MAX_KEYS_PER_MESSAGE}")
    _exact(body, 4 + n * KEY_SIZE, what)
    return KeysRequest([_key_at(body, 4 + i * KEY_SIZE) for i in range(n)])


def encode_get_reply_parts(frames: Sequence[Buffer | None]) -> list[Buffer]:
    """Body parts of a GET_OK (frames are not copied)."""
    parts: list[Buffer] = [_U32.pack(len(frames))]
    for f in frames:
        if f is None:
            parts.append(_U64.pack(0))
        else:
            parts.append(_U64.pack(memoryview(f).nbytes))
            parts.append(f)
    return parts


def _decode_get_reply(body: memoryview) -> GetReply:
    if body.nbytes < 4:
        raise ProtocolError("GET_OK body is truncated")
    (n,) = _U32.unpack_from(body, 0)
    if n > MAX_KEYS_PER_MESSAGE:
        raise ProtocolError(f"GET_OK claims {n} entries")
    off = 4
    frames: list[memoryview | None] = []
    for _ in range(n):
        if off + 8 > body.nbytes:
            raise ProtocolError("GET_OK entry length is truncated")
        (flen,) = _U64.unpack_from(body, off)
        off += 8
        if flen > body.nbytes - off:
            raise ProtocolError("GET_OK frame runs past the end of the body")
        frames.append(body[off : off + flen] if flen else None)
        off += flen
    if off != body.nbytes:
        raise ProtocolError(f"GET_OK has {body.nbytes - off} trailing bytes")
    return GetReply(frames)


_LOC = struct.Struct(">QQQ")


def encode_locate_reply(entries: Sequence[tuple[int, int, int]]) -> bytes:
    """LOCATE_OK body: count, then ``(offset, length, generation)`` per key."""
    return _U32.pack(len(entries)) + b"".join(_LOC.pack(*e) for e in entries)


def _decode_locate_reply(body: memoryview) -> LocateReply:
    if body.nbytes < 4:
        raise ProtocolError("LOCATE_OK body is truncated")
    (n,) = _U32.unpack_from(body, 0)
    if n > MAX_KEYS_PER_MESSAGE:
        raise ProtocolError(f"LOCATE_OK claims {n} entries")
    _exact(body, 4 + n * _LOC.size, "LOCATE_OK")
    return LocateReply([_LOC.unpack_from(body, 4 + i * _LOC.size) for i in range(n)])


_EVH = struct.Struct(">QQI")


def encode_evictions_reply(first: int, head: int, keys: Sequence[bytes]) -> bytes:
    """EVICTIONS_OK body: first u64 | head u64 | count u32 | 32-byte keys."""
    if len(keys) > MAX_EVICTIONS_PER_REPLY:
        raise ValueError(f"at most {MAX_EVICTIONS_PER_REPLY} keys per EVICTIONS_OK")
    return _EVH.pack(first, head, len(keys)) + b"".join(keys)


def _decode_evictions_reply(body: memoryview) -> EvictionsReply:
    if body.nbytes < _EVH.size:
        raise ProtocolError("EVICTIONS_OK body is truncated")
    first, head, n = _EVH.unpack_from(body, 0)
    if n > MAX_EVICTIONS_PER_REPLY:
        raise ProtocolError(f"EVICTIONS_OK claims {n} keys, more than {MAX_EVICTIONS_PER_REPLY}")
    if first + n > head:
        raise ProtocolError(f"EVICTIONS_OK runs past its head ({first} + {n} > {head})")
    _exact(body, _EVH.size + n * KEY_SIZE, "EVICTIONS_OK")
    return EvictionsReply(first, head, [_key_at(body, _EVH.size + i * KEY_SIZE) for i in range(n)])


def parse_body(mtype: int, body: Buffer) -> Body:
    """Decode the body of a message of type ``mtype`` (already bounded in size)."""
    mv = memoryview(body).cast("B")
    if mtype == CHALLENGE:
        _exact(mv, NONCE_SIZE + SERVER_ID_SIZE, "CHALLENGE")
        return Challenge(bytes(mv[:NONCE_SIZE]), bytes(mv[NONCE_SIZE:]))
    if mtype == AUTH:
        _exact(mv, NONCE_SIZE + MAC_SIZE, "AUTH")
        return Auth(bytes(mv[:NONCE_SIZE]), bytes(mv[NONCE_SIZE:]))
    if mtype == AUTH_TENANT:
        if not NONCE_SIZE + MAC_SIZE < mv.nbytes <= NONCE_SIZE + MAC_SIZE + MAX_TENANT_NAME:
            raise ProtocolError(
                f"AUTH_TENANT body must be {NONCE_SIZE + MAC_SIZE + 1}..{NONCE_SIZE + MAC_SIZE + MAX_TENANT_NAME} bytes"
            )
        name = bytes(mv[NONCE_SIZE + MAC_SIZE :]).decode("ascii", errors="replace")
        if not TENANT_NAME_RE.match(name):
            raise ProtocolError("AUTH_TENANT tenant name is not [A-Za-z0-9._-]{1,64}")
        return AuthTenant(bytes(mv[:NONCE_SIZE]), bytes(mv[NONCE_SIZE : NONCE_SIZE + MAC_SIZE]), name)
    if mtype == AUTH_OK:
        _exact(mv, MAC_SIZE, "AUTH_OK")
        return AuthOk(bytes(mv))
    if mtype in (LOOKUP, GET, REMOVE, LOCATE):
        return _decode_keys(mv, TYPE_NAMES[mtype])
    if mtype in (LOOKUP_OK, REMOVE_OK):
        _exact(mv, 4, TYPE_NAMES[mtype])
        return Count(_U32.unpack(mv)[0])
    if mtype == GET_OK:
        return _decode_get_reply(mv)
    if mtype == PUT:
        if mv.nbytes <= KEY_SIZE:
            raise ProtocolError("PUT body holds no frame")
        return PutRequest(_key_at(mv, 0), mv[KEY_SIZE:])
    if mtype == PUT_OK:
        _exact(mv, 1, "PUT_OK")
        if mv[0] not in (0, 1):
            raise ProtocolError(f"PUT_OK status must be 0 or 1, got {mv[0]}")
        return PutReply(bool(mv[0]))
    if mtype == SHM_ATTACH:
        _exact(mv, 0, "SHM_ATTACH")
        return ShmAttach()
    if mtype == SHM_OK:
        _exact(mv, 8, "SHM_OK")
        return ShmOk(_U64.unpack(mv)[0])
    if mtype == LOCATE_OK:
        return _decode_locate_reply(mv)
    if mtype == EVICTIONS:
        _exact(mv, 8, "EVICTIONS")
        return EvictionsRequest(_U64.unpack(mv)[0])
    if mtype == EVICTIONS_OK:
        return _decode_evictions_reply(mv)
    if mtype == ERROR:
        if mv.nbytes > MAX_ERROR_TEXT:
            raise ProtocolError("ERROR text is too long")
        return ErrorReply(bytes(mv).decode("utf-8", errors="replace"))
    raise ProtocolError(f"unknown message type {mtype}")


def parse_message(data: Buffer, max_body: int) -> tuple[Header, Body]:
    """Decode one complete message (header and body, nothing more)."""
    mv = memoryview(data).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise ProtocolError("truncated: shorter than a header")
    header = decode_header(mv[:HEADER_SIZE], max_body)
    if mv.nbytes - HEADER_SIZE != header.body_len:
        raise ProtocolError(f"body is {mv.nbytes - HEADER_SIZE} bytes, header says {header.body_len}")
    return header, parse_body(header.type, mv[HEADER_SIZE:])


def message_parts(mtype: int, request_id: int, body_parts: Sequence[Buffer]) -> list[Buffer]:
    """Header plus body parts, ready to send without joining the (large) parts."""
    total = sum(memoryview(p).nbytes for p in body_parts)
    return [pack_header(mtype, request_id, total), *body_parts]


def encode_message(mtype: int, request_id: int, body_parts: Sequence[Buffer] = ()) -> bytes:
    return b"".join(bytes(p) for p in message_parts(mtype, request_id, body_parts))


def u32(n: int) -> bytes:
    return _U32.pack(n)


def u64(n: int) -> bytes:
    return _U64.pack(n)
