"""Chunk keys: a chained prefix hash over token ids, plus a namespace.

Chunk i's hash is ``H(hash_{i-1} || len || token_ids_i || extra_i)``, so a key names a
chunk *and* everything before it. ``H`` is keyed BLAKE2b with a 128-bit digest: the
same bytes give the same key in every process and on every machine (never Python's
``hash()``, which changes with PYTHONHASHSEED).

The namespace (model, KV layout fingerprint, TP rank and world size, dtype, tenant
salt) makes incompatible caches miss instead of colliding. The chain itself is seeded
per request (tags), so the scheduler can hash once and the worker combines the hashes
with its own namespace.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

HASH_BYTES = 16
KEY_FORMAT_VERSION = 1
_HASH_KEY = b"lmcache-core/chunk-key/v1"
_LEN = struct.Struct("<II")

TokenIds = Sequence[int] | np.ndarray | array


# The keyed hash's state right after its key block: copying it is the same hash as
# keying a new one, without compressing the key block again for every chunk.
_KEYED = hashlib.blake2b(digest_size=HASH_BYTES, key=_HASH_KEY)
# array typecode of a 4-byte unsigned int (converting a Python list to it is several
# times faster than numpy's conversion, and checks the range on the way)
_U32 = next((c for c in ("I", "L") if array(c).itemsize == 4), None)


def _h(data: bytes) -> bytes:
    h = _KEYED.copy()
    h.update(data)
    return h.digest()


def chain_seed(tags: Mapping[str, str] | None = None) -> bytes:
    """The hash every chain starts from. Tags (per-request ``lmcache.tag.<name>``)
    change the seed, so differently tagged requests never share chunks."""
    if not tags:
        return _h(b"seed")
    canon = json.dumps(sorted((str(k), str(v)) for k, v in tags.items()), separators=(",", ":"))
    return _h(b"seed/tags:" + canon.encode())


def as_token_array(tokens: TokenIds) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array (a view where possible)."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.dtype("<u4") and tokens.ndim == 1 and tokens.flags.c_contiguous:
            return tokens  # already the form this returns: every uint32 is in range
        arr = tokens
    elif isinstance(tokens, array):
        arr = np.frombuffer(tokens, dtype=np.dtype(tokens.typecode))
    elif _U32 is not None and isinstance(tokens, (list, tuple)):
        try:  # a list of ints (vLLM's prompt_token_ids): the fast path, range checked by array
            u32 = array(_U32, tokens)
        except OverflowError:
            raise ValueError("token ids must be in [0, 2**32)") from None
        except TypeError:
            u32 = None  # not all ints: numpy says what is wrong below
        if u32 is not None:
            out = np.frombuffer(u32, dtype=np.uint32)
            return out if sys.byteorder == "little" else out.astype("<u4")
        arr = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    else:
        arr = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a 1-D sequence of integers, got {arr.dtype}{list(arr.shape)}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_hashes(
    tokens: TokenIds,
    chunk_size: int,
    *,
    seed: bytes | None = None,
    extras: Mapping[int, bytes] | None = None,
    include_partial: bool = False,
    start: bytes | None = None,
    first_chunk: int = 0,
) -> list[bytes]:
    """Prefix hashes of the chunks of ``tokens``.

    ``extras[i]`` is mixed into chunk i (multimodal content hashes: two images behind
    the same placeholder tokens get different keys). A trailing partial chunk is
    hashed only with ``include_partial``. ``start``/``first_chunk`` resume a chain
    (the hash of chunk ``first_chunk - 1``) so long prompts are hashed incrementally.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    arr = as_token_array(tokens)
    buf = arr.data.cast("B")  # a view, no copy: the hash reads slices of it
    n = arr.size
    prev = start if start is not None else (seed if seed is not None else chain_seed())
    out: list[bytes] = []
    width = chunk_size * 4
    i = first_chunk
    while True:
        lo = i * chunk_size
        if lo >= n:
            break
        hi = min(lo + chunk_size, n)
        if hi - lo < chunk_size and not include_partial:
            break
        extra = extras.get(i, b"") if extras else b""
        prev = _chunk_key(prev, buf[lo * 4 : lo * 4 + width] if hi - lo == chunk_size else buf[lo * 4 : hi * 4], hi - lo, extra)
        out.append(prev)
        i += 1
    return out


def _chunk_key(prev: bytes, data: memoryview, count: int, extra: bytes) -> bytes:
    """The key of one chunk of ``count`` tokens (``data``: their bytes) after ``prev``."""
    h = _KEYED.copy()
    h.update(prev)
    h.update(_LEN.pack(count, len(extra)))
    h.update(data)
    if extra:
        h.update(extra)
    return h.digest()


def leading_part_keys(
    tokens: TokenIds,
    chunk_size: int,
    hashes: Sequence[bytes],
    count: int,
    *,
    seed: bytes,
    extras: Mapping[int, bytes] | None = None,
) -> list[bytes]:
    """For each whole chunk ``i`` of ``tokens`` (``hashes``: their keys from
    :func:`chunk_hashes` with the same ``seed``), the key its first ``count`` tokens
    have as a trailing partial chunk: ``chunk_hashes(tokens[: i * chunk_size + count],
    chunk_size, seed=seed, include_partial=True)[-1]``, without hashing the chain again."""
    if not 0 < count < chunk_size:
        raise ValueError("count must be between 0 and chunk_size, exclusive")
    buf = as_token_array(tokens).data.cast("B")
    out = []
    for i in range(min(len(hashes), len(buf) // 4 // chunk_size)):
        lo = i * chunk_size * 4
        extra = extras.get(i, b"") if extras else b""
        out.append(_chunk_key(hashes[i - 1] if i else seed, buf[lo : lo + count * 4], count, extra))
    return out


def sub_chunk_hashes(prev: bytes, tokens: TokenIds, step: int, *, extra: bytes = b"", count: int | None = None) -> list[bytes]:
    """Hashes of the first ``step``, ``2*step``, ... tokens of one chunk's ``tokens``
    (``count`` of them, by default every whole step below the chunk's end), chained
    from ``prev``, the hash of the chunk before (or the seed).

    They name *part* of a chunk, for sub-chunk hits: a prompt that shares a stored
    chunk's first blocks but not its rest. The domain differs from chunk keys (a
    sub-chunk hash is never a storage key) and the length is not hashed first, so one
    pass over the tokens gives every prefix: ``h(extra, prev, block 1)``, then the
    same state updated with block 2, and so on.
    """
    if step <= 0:
        raise ValueError("step must be positive")
    arr = as_token_array(tokens)
    n = arr.size // step if count is None else min(count, arr.size // step)
    if count is None and n * step == arr.size:
        n -= 1  # the whole chunk is its own key, not a sub-chunk
    if n <= 0:
        return []
    buf = arr.data.cast("B")
    h = _KEYED.copy()
    h.update(b"sub/v1")
    h.update(_LEN.pack(len(prev), len(extra)))
    h.update(prev)
    h.update(extra)
    out: list[bytes] = []
    width = step * 4
    for j in range(n):
        h.update(buf[j * width : (j + 1) * width])
        out.append(h.copy().digest())
    return out


@dataclass(frozen=True)
class KeyNamespace:
    """What must match for two caches to share KV. Its ``id`` goes into every key."""

    model: str
    layout: str = "unspecified"
    dtype: str = "unspecified"
    world_size: int = 1
    rank: int = 0
    salt: str | None = None

    def canonical(self) -> str:
        return json.dumps(
            {
                "v": KEY_FORMAT_VERSION,
                "model": self.model,
                "layout": self.layout,
                "dtype": self.dtype,
                "world_size": self.world_size,
                "rank": self.rank,
                "salt": self.salt,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @property
    def id(self) -> bytes:
        return _h(b"ns:" + self.canonical().encode())

    def key(self, chunk_hash: bytes) -> "ChunkKey":
        return ChunkKey(self.id, chunk_hash)

    def keys(self, hashes: Iterable[bytes]) -> list["ChunkKey"]:
        ns = self.id
        return [ChunkKey(ns, h) for h in hashes]


class _KeyParts(NamedTuple):
    namespace: bytes
    chunk_hash: bytes


class ChunkKey(_KeyParts):
    """A chunk's identity: namespace id + prefix hash. ``str(key)`` is the one
    canonical string form (file and object names); :meth:`parse` inverts it.

    A tuple underneath: hashing and comparing it run in C (a key is hashed several
    times per stored chunk: tier indexes, eviction policy), and two keys are equal when
    both parts are. Immutable; built only through the validating constructor."""

    __slots__ = ()

    def __new__(cls, namespace: bytes, chunk_hash: bytes) -> "ChunkKey":
        if len(namespace) != HASH_BYTES or len(chunk_hash) != HASH_BYTES:
            raise ValueError("namespace and chunk_hash must be 16 bytes each")
        return super().__new__(cls, bytes(namespace), bytes(chunk_hash))

    def to_str(self) -> str:
        return f"v{KEY_FORMAT_VERSION}-{self.namespace.hex()}-{self.chunk_hash.hex()}"

    __str__ = to_str

    @classmethod
    def parse(cls, text: str) -> "ChunkKey":
        parts = text.split("-")
        if len(parts) != 3 or parts[0] != f"v{KEY_FORMAT_VERSION}":
            raise ValueError(f"not a chunk key: {text!r}")
        try:
            ns, ch = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
        except ValueError:
            raise ValueError(f"not a chunk key: {text!r}") from None
        if len(ns) != HASH_BYTES or len(ch) != HASH_BYTES or parts[1] != ns.hex() or parts[2] != ch.hex():
            raise ValueError(f"not a chunk key: {text!r}")
        return cls(ns, ch)
