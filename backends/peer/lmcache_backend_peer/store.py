"""What a peer serves: chunks as serde frames, in memory, LRU within a byte budget.

Frames (not tensors) because a frame is exactly what goes on the wire: serving a hit
is a send of bytes already held, and the reader verifies key and checksum itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Protocol, Sequence

from lmcache_core.backend import EraseMatch
from lmcache_core.frames import FrameError, FrameHeader
from lmcache_core.keys import ChunkKey


class ChunkSource(Protocol):
    """What :class:`~lmcache_backend_peer.server.PeerServer` serves from."""

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        """Prefix count of ``keys`` held."""

    def get_frame(self, key: ChunkKey) -> bytes | memoryview | None:
        """The serde frame of ``key``, or None."""


class FrameStore:
    """Thread-safe LRU map of key -> frame bytes, bounded by ``max_size`` bytes.
    A ``max_size`` of 0 keeps nothing (a pure client of other peers).

    ``on_drop(key, frame)``, when set, is called for each frame evicted or removed
    (not on :meth:`clear`), under the store's lock: it must be quick."""

    on_drop: Callable[[ChunkKey, bytes], None] | None = None

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("max_size must not be negative")
        self.max_size = max_size
        self._lock = threading.Lock()
        self._frames: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._bytes = 0
        self.evictions = 0

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
            return frame

    def put_frame(self, key: ChunkKey, frame: bytes) -> bool:
        """Keep ``frame``, evicting least recently used ones; False if it can never fit."""
        size = len(frame)
        if size > self.max_size:
            return False
        with self._lock:
            if key in self._frames:
                self._frames.move_to_end(key)
                return True
            while self._bytes + size > self.max_size and self._frames:
                gone, old = self._frames.popitem(last=False)
                self._bytes -= len(old)
                self.evictions += 1
                if self.on_drop is not None:
                    self.on_drop(gone, old)
            self._frames[key] = frame
            self._bytes += size
        return True

    def remove(self, key: ChunkKey, report: bool = True) -> bool:
        """Drop ``key``; ``report=False``: without telling ``on_drop``."""
        with self._lock:
            frame = self._frames.pop(key, None)
            if frame is None:
                return False
            self._bytes -= len(frame)
            if report and self.on_drop is not None:
                self.on_drop(key, frame)
            return True

    def clear(self) -> None:
        with self._lock:
            self._frames.clear()
            self._bytes = 0

    def entries(self) -> list[tuple[ChunkKey, bytes]]:
        """A snapshot of ``(stored key, frame)`` pairs, least recently used first."""
        with self._lock:
            return list(self._frames.items())

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
