"""The same-host fast path: a cache node's frames in shared memory, read in place.

Node side (:class:`ArenaStore`): each principal of the node (every tenant of the
tenants file, and the shared secret's untenanted part) has its own arena, one
``memfd`` of ``max_size / principals`` bytes. Only the node maps it writable; right
after mapping it the node seals it (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_FUTURE_WRITE | F_SEAL_SEAL``), so no process can ever map it writable again,
change its size (a reader can never fault on a truncated mapping), or lift the seals.
An arena is a set of slots, first-fit over a coalescing free list, evicted LRU within
the arena. A slot is a 128-byte header, then the frame as pushed::

    generation u64 | key 32 bytes | frame length u64 | payload offset u32 |
    raw length u64 | codec 12 bytes | dtype 12 bytes | ndim u8 | pad 3 | shape 5 x u64

The generation is even while the slot is stable and odd while the node rewrites or
frees it; every write takes a fresh value from the arena's counter, so a value is
never seen twice at one offset.

Engine side (:class:`ShmView`): an engine that authenticated on the node's Unix
socket receives its own principal's arena fd (``SCM_RIGHTS``), checks the seals and
maps it read-only. A LOCATE answers ``(offset, frame length, generation)`` per key;
the engine checks the slot header (generation, key, and the frame's codec, dtype
and shape against its output: :meth:`~lmcache_core.frames.FrameReader.check`), copies the
frame's header out and parses it (it must agree with the slot header), copies the
payload straight into its output, then re-reads the generation and the key
(seqlock): a slot rewritten or freed meanwhile is a miss, never wrong KV. The copy
in the output is then hashed and checked against the frame's checksum, or its MAC
when the engine has a frame secret: the node verified each frame when it accepted
the PUT, but bytes in an arena can still be changed by any process of the node's
user (``/proc/<pid>/mem``), and a node without the secret cannot check a MAC.

The seqlock's reads rely on loads not passing earlier loads (x86-64); elsewhere the
engine does not use the fast path (:data:`SHM_SUPPORTED`) and reads over the socket.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import platform
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from lmcache_core.backend import EraseMatch
from lmcache_core.keys import ChunkKey
from lmcache_core.frames import Codec, FrameError, FrameHeader, FrameReader
from lmcache_core.retention import Retention

from .protocol import KEY_SIZE, key_bytes
from .store import RETAIN_SHARE, Retaining

log = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
"""Seals every arena carries (the engine refuses an fd without them)."""

SLOT_HEADER = 128
MAX_NDIM = 5
_GEN = struct.Struct("<Q")
_SLOT = struct.Struct("<Q32sQ")
_HEAD = struct.Struct("<Q32sQIQ12s12sB3x5Q")
assert _HEAD.size == SLOT_HEADER
ALIGN = 64
FREED = 1
"""Generation word of a free slot (odd: never matches a located generation)."""

SHM_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create")
"""Whether this host can use the fast path (memfd, fd passing, x86-64 load ordering)."""


class ShmUnavailable(Exception):
    """The fast path cannot be set up here (the node falls back to its socket)."""


@dataclass(frozen=True)
class Location:
    """Where a key's frame lies in the arena, and the slot's generation then."""

    offset: int
    length: int
    generation: int


@dataclass
class _Slot:
    offset: int
    span: int
    length: int
    generation: int


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena(Retaining):
    """One principal's shared-memory frames (node side). Thread-safe."""

    def __init__(self, name: str, size: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise ShmUnavailable("this platform has no memfd_create")
        size = size // ALIGN * ALIGN
        if size < ALIGN:
            raise ValueError("an arena needs at least 64 bytes")
        self.size = size
        self.fd = os.memfd_create(f"lmcache-node-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
            except OSError as err:
                self._mm.close()
                raise ShmUnavailable(f"cannot seal the arena (kernel before 5.1?): {err}") from None
        except BaseException:
            os.close(self.fd)
            raise
        self._lock = threading.Lock()
        self._slots: OrderedDict[ChunkKey, _Slot] = OrderedDict()
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, coalesced
        self._counter = 0
        self.evictions = 0
        self.bytes_used = 0
        self.write_hook: object = None  # tests: called between a slot's odd and even generation
        #: called with each key evicted or removed (not on clear), under the lock
        self.on_drop: Callable[[ChunkKey], None] | None = None
        #: chunks kept through eviction for a while (as in FrameStore: the admin API)
        self.retention: Retention[ChunkKey] = Retention(size, RETAIN_SHARE)

    # -- allocator ----------------------------------------------------------------------
    def _take(self, need: int) -> int | None:
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                return off
        return None

    def _give(self, off: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + length == self._free[i][0]:
            length += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            off, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (off, length))

    def _release(self, slot: _Slot) -> None:
        _GEN.pack_into(self._mm, slot.offset, FREED)  # readers of the old frame now miss
        self.bytes_used -= slot.span
        self._give(slot.offset, slot.span)

    def _next_generation(self) -> int:
        self._counter += 2
        return self._counter

    # -- source API (keys are the principal's own) ------------------------------------------
    def put_frame(self, key: ChunkKey, frame: bytes | memoryview) -> bool:
        """Keep ``frame`` (its checksum already verified by the caller), evicting LRU
        slots; False when its header is not a frame of ``key`` with at most
        :data:`MAX_NDIM` dimensions, or it can never fit this arena."""
        data = memoryview(frame).cast("B")
        need = _align(SLOT_HEADER + data.nbytes)
        if need > self.size:
            return False
        try:
            info = FrameHeader.parse(data)
            span = info.offset
        except FrameError:
            return False
        if info.key != key.to_str() or len(info.shape) > MAX_NDIM or len(info.codec) > 12 or len(info.dtype) > 12:
            return False
        shape = list(info.shape) + [0] * (MAX_NDIM - len(info.shape))
        with self._lock:
            if key in self._slots:
                self._slots.move_to_end(key)
                return True
            off = self._take(need)
            while off is None:
                if not self._evict_one():
                    return False  # only retained slots left (or none: cannot happen)
                off = self._take(need)
            gen = self._next_generation()
            _GEN.pack_into(self._mm, off, gen - 1)  # odd: being written
            if self.write_hook is not None:
                self.write_hook()  # type: ignore[operator]
            _HEAD.pack_into(
                self._mm,
                off,
                gen - 1,
                key_bytes(key),
                data.nbytes,
                span,
                info.raw_len,
                info.codec.encode(),
                info.dtype.encode(),
                len(info.shape),
                *shape,
            )
            self._mm[off + SLOT_HEADER : off + SLOT_HEADER + data.nbytes] = data
            _GEN.pack_into(self._mm, off, gen)
            self._slots[key] = _Slot(off, need, data.nbytes, gen)
            self.bytes_used += need
            self.retention.arrived(key, need)
        return True

    def _evict_one(self) -> bool:
        """Evict the least recently used slot that is not retained (retained ones passed
        over move to the recently used end); False when every slot is. Under the lock."""
        for _ in range(len(self._slots)):
            key = next(iter(self._slots))
            if self.retention.protects(key):
                self._slots.move_to_end(key)
                continue
            self._release(self._slots.pop(key))
            self.retention.forget(key)
            self.evictions += 1
            if self.on_drop is not None:
                self.on_drop(key)
            return True
        return False

    def _held_size(self, key: ChunkKey) -> int | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.span

    def get_frame(self, key: ChunkKey) -> bytes | None:
        """A copy of the frame (for the socket path; taken under the lock)."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            self._slots.move_to_end(key)
            return self._mm[slot.offset + SLOT_HEADER : slot.offset + SLOT_HEADER + slot.length]

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._slots:
                    break
                n += 1
        return n

    def locate(self, keys: Sequence[ChunkKey]) -> list[Location | None]:
        """Where each key's frame lies now (None: not held); counts as a use (LRU)."""
        out: list[Location | None] = []
        with self._lock:
            for k in keys:
                slot = self._slots.get(k)
                if slot is None:
                    out.append(None)
                    continue
                self._slots.move_to_end(k)
                out.append(Location(slot.offset, slot.length, slot.generation))
        return out

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                return False
            self._release(slot)
            self.retention.forget(key)
            if self.on_drop is not None:
                self.on_drop(key)
            return True

    def clear(self) -> None:
        with self._lock:
            for slot in self._slots.values():
                _GEN.pack_into(self._mm, slot.offset, FREED)
            self._slots.clear()
            self._free = [(0, self.size)]
            self.bytes_used = 0
            self.retention = Retention(self.size, RETAIN_SHARE)

    def __len__(self) -> int:
        return len(self._slots)

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """Drop every slot whose key ``match`` takes (keys here are the principal's own);
        how many went. As :meth:`~lmcache_backend_peer.store.FrameStore.erase`."""
        with self._lock:
            keys = [k for k in self._slots if match.namespaces is None or k.namespace in match.namespaces]
        n = 0
        for k in keys:
            if dry_run or self.remove(k):
                n += 1
                if progress is not None:
                    progress(n)
        return n

    def close(self) -> None:
        """Unmap and close the node's fd (engines' mappings stay valid until they drop them)."""
        with self._lock:
            self._slots.clear()
            if not self._mm.closed:
                self._mm.close()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


class ArenaStore:
    """The node's store with the fast path: one :class:`Arena` per principal (``None``
    is the shared secret's untenanted part), ``max_size`` split evenly among them; a
    principal with a quota gets an arena of its quota instead, if smaller (each arena
    is its principal's own: a principal never evicts another's chunks)."""

    def __init__(self, max_size: int, principals: Sequence[str | None], quotas: Mapping[str | None, int] | None = None) -> None:
        if max_size < 0:
            raise ValueError("max_size must not be negative")
        names = list(dict.fromkeys(principals))
        if not names:
            raise ValueError("an arena store needs at least one principal")
        self.max_size = max_size
        share = max_size // len(names)
        self.arenas: dict[str | None, Arena] = {}
        try:
            for p in names:
                size = min(share, (quotas or {}).get(p, share))
                self.arenas[p] = Arena("shared" if p is None else f"tenant-{p}", max(size, ALIGN))
        except BaseException:
            self.close()
            raise

    def arena_for(self, principal: str | None) -> Arena | None:
        return self.arenas.get(principal)

    # The untenanted part, as a plain source (tests and tools that hold the store).
    def _shared(self) -> Arena:
        arena = self.arenas.get(None)
        if arena is None:
            raise KeyError("this node has no shared-secret arena (tenants only)")
        return arena

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        return self._shared().contains(keys)

    def get_frame(self, key: ChunkKey) -> bytes | None:
        return self._shared().get_frame(key)

    def put_frame(self, key: ChunkKey, frame: bytes) -> bool:
        return self._shared().put_frame(key, frame)

    def remove(self, key: ChunkKey) -> bool:
        return self._shared().remove(key)

    def clear(self) -> None:
        for a in self.arenas.values():
            a.clear()

    def __len__(self) -> int:
        return sum(len(a) for a in self.arenas.values())

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """Erase ``match`` from every principal's arena; how many slots went."""
        return sum(a.erase(match, progress, dry_run=dry_run) for a in self.arenas.values())

    def erase_owner(self, owner: str | None, *, dry_run: bool = False) -> int:
        """Empty ``owner``'s arena (its chunks only); how many slots went."""
        arena = self.arenas.get(owner)
        return 0 if arena is None else arena.erase(EraseMatch(None), dry_run=dry_run)

    @property
    def bytes_used(self) -> int:
        return sum(a.bytes_used for a in self.arenas.values())

    @property
    def evictions(self) -> int:
        return sum(a.evictions for a in self.arenas.values())

    def close(self) -> None:
        for a in self.arenas.values():
            a.close()


class ShmView:
    """An engine's read-only mapping of its arena on the node ``server_id``."""

    def __init__(self, fd: int, size: int, server_id: bytes) -> None:
        """Check and map ``fd`` (taking ownership: it is closed here either way)."""
        try:
            st = os.fstat(fd)
            if st.st_size != size or size < SLOT_HEADER:
                raise ShmUnavailable(f"arena fd is {st.st_size} bytes, the node announced {size}")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & ARENA_SEALS != ARENA_SEALS:
                raise ShmUnavailable(f"arena fd lacks its seals ({seals:#x}; need {ARENA_SEALS:#x})")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as err:
            raise ShmUnavailable(f"cannot map the arena: {err}") from None
        finally:
            os.close(fd)
        self.size = size
        self.server_id = server_id
        self._mv = memoryview(self._mm)
        self.read_hook: object = None  # tests: called between the copy and the re-check

    def _stable(self, loc: Location, key: bytes) -> bool:
        gen, kb, length = _SLOT.unpack_from(self._mv, loc.offset)
        return gen == loc.generation and kb == key and length == loc.length

    def read(self, key: ChunkKey, loc: Location, out: torch.Tensor, codecs: Mapping[str, Codec]) -> str | None:
        """Copy ``key``'s frame at ``loc`` into ``out``; None on success, else why it
        is a miss (the slot moved on, or the frame does not fit ``out``)."""
        if loc.generation & 1 or loc.offset % ALIGN or loc.offset + SLOT_HEADER + loc.length > self.size:
            return "location out of range"
        kb = key_bytes(key)
        gen, got_key, length, span, raw_len, codec_name, dtype, ndim, *shape = _HEAD.unpack_from(self._mv, loc.offset)
        if gen != loc.generation or got_key != kb or length != loc.length:
            return "slot reused"
        start = loc.offset + SLOT_HEADER
        try:
            dtype_name = dtype.rstrip(b"\0").decode("ascii")
            if ndim > MAX_NDIM or span > length or dtype_name not in FrameHeader.DTYPES:
                raise FrameError("slot header is malformed")
            info = FrameHeader(
                key.to_str(), codec_name.rstrip(b"\0").decode("ascii"), dtype_name, tuple(shape[:ndim]), raw_len, length - span
            )
            reader = FrameReader(codecs)
            reader.check(info, key=key, out=out)  # the slot's fields: no metadata, so no seal yet
            frame_info = FrameHeader.parse(bytes(self._mv[start : start + span]), length)
            if frame_info != info:
                raise FrameError("slot header and frame header disagree")
            hasher = reader.verifier(frame_info)  # raises unless sealed as this engine expects
            payload = self._mv[start + span : start + length]
            if info.codec != "raw":  # hash and decode one private copy
                payload = memoryview(bytes(payload))
                hasher.update(payload)
            reader.decode_unverified(info, payload, out)
            if info.codec == "raw":  # hash what was copied: what this read serves
                hasher.update(out)
        except FrameError as err:
            return "slot reused" if not self._stable(loc, kb) else str(err)
        except Exception as err:  # a codec fed a slot rewritten under it
            return "slot reused" if not self._stable(loc, kb) else f"{type(err).__name__}: {err}"
        if self.read_hook is not None:
            self.read_hook()  # type: ignore[operator]
        if not self._stable(loc, kb):
            return "slot reused"
        if not hasher.matches():
            return "MAC mismatch" if frame_info.sealed else "checksum mismatch"
        return None


def decode_locations(entries: Sequence[tuple[int, int, int]]) -> list[Location | None]:
    return [Location(o, n, g) if n else None for o, n, g in entries]


assert KEY_SIZE == 32
