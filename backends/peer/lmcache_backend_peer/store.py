"""What a peer serves: chunks as serde frames, in memory, LRU within a byte budget.

Frames (not tensors) because a frame is exactly what goes on the wire: serving a hit
is a send of bytes already held, and the reader verifies key and checksum itself.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from lmcache_core.backend import EraseMatch
from lmcache_core.frames import FrameError, FrameHeader
from lmcache_core.keys import ChunkKey
from lmcache_core.retention import Retention

RETAIN_SHARE = 0.5
"""The share of a store (of an arena) that retained chunks may hold at most: past it
the weakest retentions are released (:class:`~lmcache_core.retention.Retention`)."""


class ChunkSource(Protocol):
    """What :class:`~lmcache_backend_peer.server.PeerServer` serves from."""

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        """Prefix count of ``keys`` held."""

    def get_frame(self, key: ChunkKey) -> bytes | memoryview | None:
        """The serde frame of ``key``, or None."""


class Retaining:
    """Retention for a store that keeps ``retention`` under ``_lock`` and says a held
    key's size (``_held_size``): what the admin API's retain and release call."""

    _lock: threading.Lock
    retention: Retention[ChunkKey]

    def _held_size(self, key: ChunkKey) -> int | None:
        raise NotImplementedError

    def retain(self, keys: Sequence[ChunkKey], seconds: float, priority: int = 0) -> int:
        """Keep ``keys`` (as stored) through eviction for ``seconds`` (extend-only;
        at most 30 days), at ``priority`` (0-99: the strongest kept first when the
        retained bytes pass their share); a key not held yet is retained when it
        arrives. How many held keys are retained now."""
        with self._lock:
            return self.retention.add(keys, seconds, priority, self._held_size)

    def release(self, keys: Sequence[ChunkKey]) -> int:
        """End the retention of ``keys``; how many were retained."""
        with self._lock:
            return sum(self.retention.release(k) for k in keys)

    def retention_stats(self) -> dict[str, int]:
        """Retained chunks and bytes now, and the retention counters."""
        with self._lock:
            return self.retention.stats()


class FrameStore(Retaining):
    """Thread-safe LRU map of key -> frame bytes, bounded by ``max_size`` bytes.
    A ``max_size`` of 0 keeps nothing (a pure client of other peers).

    Each frame has an owner (the principal that put it: a tenant's name, or None for
    the shared secret's principal and for a node without tenants). ``quotas`` bounds
    some owners' bytes hard: a put by an owner at its quota evicts that owner's own
    least recently used frames first, never another owner's; a frame larger than the
    quota is refused (counted). Node-wide pressure (``max_size``) evicts the least
    recently used frame of any owner, as without quotas. :meth:`usage` reports chunks,
    bytes, quota, refused puts and self-evictions per owner, in O(owners).

    Chunks may be *retained* for a while (:meth:`retain`, the admin API's ``POST
    /retain``): eviction, node-wide or within a quota, passes over a retained chunk
    (moving it to the most recently used end) until its time is up; retained bytes
    are bounded by :data:`RETAIN_SHARE` of ``max_size``. A put that finds only retained
    chunks to evict (of its owner at its quota, or node-wide) is refused (counted).

    ``on_drop(key, frame)``, when set, is called for each frame evicted or removed
    (not on :meth:`clear`), under the store's lock: it must be quick."""

    on_drop: Callable[[ChunkKey, bytes], None] | None = None

    def __init__(self, max_size: int, quotas: Mapping[str | None, int] | None = None) -> None:
        if max_size < 0:
            raise ValueError("max_size must not be negative")
        bad = {k: v for k, v in (quotas or {}).items() if v <= 0}
        if bad:
            raise ValueError(f"quotas must be positive, got {bad}")
        self.max_size = max_size
        self.quotas: dict[str | None, int] = dict(quotas or {})
        self._lock = threading.Lock()
        self._frames: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._bytes = 0
        self.evictions = 0
        #: each owner's keys, least recently used first, and its counters
        self._owned: dict[str | None, OrderedDict[ChunkKey, None]] = {}
        self._owner: dict[ChunkKey, str | None] = {}
        self._owner_bytes: Counter[str | None] = Counter()
        self.refused: Counter[str | None] = Counter()
        self.self_evictions: Counter[str | None] = Counter()
        self.retention: Retention[ChunkKey] = Retention(max_size, RETAIN_SHARE)

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._frames:
                    break
                n += 1
        return n

    def get_frame(self, key: ChunkKey) -> bytes | None:
        with self._lock:
            frame = self._frames.get(key)
            if frame is not None:
                self._frames.move_to_end(key)
                self._owned[self._owner[key]].move_to_end(key)
            return frame

    def put_frame(self, key: ChunkKey, frame: bytes, owner: str | None = None) -> bool:
        """Keep ``frame`` for ``owner``, evicting least recently used ones (the
        owner's own first when it is at its quota); False if it can never fit."""
        size = len(frame)
        quota = self.quotas.get(owner)
        with self._lock:
            if size > self.max_size or (quota is not None and size > quota):
                self.refused[owner] += 1
                return False
            if key in self._frames:
                self._frames.move_to_end(key)
                self._owned[self._owner[key]].move_to_end(key)
                return True
            if quota is not None:
                mine = self._owned.get(owner)
                while mine and self._owner_bytes[owner] + size > quota:
                    if not self._evict_one(mine):
                        break
                    self.self_evictions[owner] += 1
                if self._owner_bytes[owner] + size > quota:
                    self.refused[owner] += 1  # only retained chunks of its own left
                    return False
            while self._bytes + size > self.max_size:
                if not self._evict_one(self._frames):
                    self.refused[owner] += 1  # only retained chunks left
                    return False
            self._frames[key] = frame
            self._bytes += size
            self._owner[key] = owner
            self._owned.setdefault(owner, OrderedDict())[key] = None
            self._owner_bytes[owner] += size
            self.retention.arrived(key, size)
        return True

    def _evict_one(self, order: Mapping[ChunkKey, object]) -> bool:
        """Evict the least recently used frame in ``order`` (all frames, or one owner's)
        that is not retained, moving retained ones it passes to the recently used end;
        False when every frame in ``order`` is retained. Under the lock."""
        for _ in range(len(order)):
            key = next(iter(order))
            if not self.retention.protects(key):
                self._drop(key, evicted=True)
                return True
            self._frames.move_to_end(key)
            self._owned[self._owner[key]].move_to_end(key)
        return False

    def _held_size(self, key: ChunkKey) -> int | None:
        frame = self._frames.get(key)
        return None if frame is None else len(frame)

    def _drop(self, key: ChunkKey, evicted: bool, report: bool = True) -> bytes:
        """Forget ``key`` (held by the caller under the lock); its frame."""
        frame = self._frames.pop(key)
        owner = self._owner.pop(key)
        del self._owned[owner][key]
        self._owner_bytes[owner] -= len(frame)
        self._bytes -= len(frame)
        self.retention.forget(key)
        if evicted:
            self.evictions += 1
        if report and self.on_drop is not None:
            self.on_drop(key, frame)
        return frame

    def remove(self, key: ChunkKey, report: bool = True) -> bool:
        """Drop ``key``; ``report=False``: without telling ``on_drop``."""
        with self._lock:
            if key not in self._frames:
                return False
            self._drop(key, evicted=False, report=report)
            return True

    def clear(self) -> None:
        with self._lock:
            self._frames.clear()
            self._owned.clear()
            self._owner.clear()
            self._owner_bytes.clear()
            self._bytes = 0
            self.retention = Retention(self.max_size, RETAIN_SHARE)

    def entries(self) -> list[tuple[ChunkKey, bytes]]:
        """A snapshot of ``(stored key, frame)`` pairs, least recently used first."""
        with self._lock:
            return list(self._frames.items())

    def usage(self, owners: Iterable[str | None] = ()) -> dict[str | None, dict[str, int | None]]:
        """Per owner (every owner with frames, a quota or a refused put, and each of
        ``owners``): chunks and bytes held, its quota (None: none), puts refused and
        its own frames evicted to stay within its quota."""
        with self._lock:
            owners = set(owners) | set(self._owned) | set(self.quotas) | set(self.refused)
            return {
                o: {
                    "chunks": len(self._owned.get(o, ())),
                    "bytes": self._owner_bytes[o],
                    "quota": self.quotas.get(o),
                    "refused": self.refused[o],
                    "self_evictions": self.self_evictions[o],
                }
                for o in owners
            }

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """Drop every frame whose client key ``match`` takes (the backend ``erase()``
        contract, :meth:`lmcache_core.backend.StorageBackend.erase`); how many went.
        The client key is the one the frame names (the node checked it on PUT; under
        tenants the stored key is a keyed hash of it, :mod:`.tenants`). Dropped
        frames are reported to ``on_drop`` like evictions, so engines see them go."""
        n = 0
        for stored, frame in self.entries():
            if match.namespaces is not None and client_key(stored, frame).namespace not in match.namespaces:
                continue
            if dry_run or self.remove(stored):
                n += 1
                if progress is not None:
                    progress(n)
        return n

    def erase_owner(self, owner: str | None, *, dry_run: bool = False) -> int:
        """Drop every frame ``owner`` wrote (a tenant, or None: the shared secret's),
        whatever its namespace; how many went (reported to ``on_drop`` as in :meth:`erase`)."""
        with self._lock:
            keys = list(self._owned.get(owner, ()))
        return len(keys) if dry_run else sum(self.remove(k) for k in keys)

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def bytes_used(self) -> int:
        return self._bytes


def client_key(stored: ChunkKey, frame: bytes | memoryview) -> ChunkKey:
    """The key a client sent for a stored frame: the one its header names, else (a
    frame put straight into the store, not through the server) ``stored``."""
    try:
        return ChunkKey.parse(FrameHeader.parse(frame).key)
    except (FrameError, ValueError):
        return stored
