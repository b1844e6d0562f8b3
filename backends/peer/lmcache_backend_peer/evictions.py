"""What a cache node dropped, per principal, for the engines that pushed there.

Engines announce what their tiers hold to cache-aware routers (KV events); a frame
the node evicts to make room, or that any client REMOVEs, must reach them too. The
node keeps, per principal (each tenant, and the shared secret's untenanted part), a
ring of the last ``capacity`` dropped keys, each with a sequence number (the ring's
count of drops so far). A client asks EVICTIONS "since N" and gets at most
:data:`~lmcache_backend_peer.protocol.MAX_EVICTIONS_PER_REPLY` keys from there on,
with the sequence number of the first one (later than N when N fell out of the ring:
the client then knows how many it missed) and the ring's head. The sequence starts
at 0 when the node starts; the node's server id tells a client it restarted.

Memory is fixed: 32 bytes per entry, allocated on a principal's first drop. Keys are
the principal's own (a tenant's keys as the tenant sent them), so a principal reads
only its own drops.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

from lmcache_core.keys import ChunkKey
from lmcache_core.frames import FrameError, FrameHeader

from .protocol import KEY_SIZE, MAX_EVICTIONS_PER_REPLY, key_bytes
from .tenants import tenant_key

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 16384
MAX_CAPACITY = 1 << 22


class _Ring:
    __slots__ = ("buf", "head")

    def __init__(self, capacity: int) -> None:
        self.buf = bytearray(capacity * KEY_SIZE)
        self.head = 0  # sequence number the next drop gets


class EvictionLog:
    """Rings of dropped keys, one per principal (thread-safe, quick: it runs under the
    store's lock)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"the eviction log holds 1..{MAX_CAPACITY} entries per principal")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._rings: dict[str | None, _Ring] = {}
        self._tenants: tuple[str, ...] = ()
        self.unattributed = 0  # drops whose principal could not be told (never expected)

    def record(self, principal: str | None, key: ChunkKey) -> None:
        with self._lock:
            ring = self._rings.get(principal)
            if ring is None:
                ring = self._rings[principal] = _Ring(self.capacity)
            at = (ring.head % self.capacity) * KEY_SIZE
            ring.buf[at : at + KEY_SIZE] = key_bytes(key)
            ring.head += 1

    def since(self, principal: str | None, seq: int, limit: int = MAX_EVICTIONS_PER_REPLY) -> tuple[int, int, list[bytes]]:
        """``(first, head, keys)``: the drops numbered ``first, first + 1, ...`` from
        ``seq`` on (``first > seq`` when the ring no longer holds ``seq``; a ``seq``
        past the head answers none, from the head), at most ``limit`` of them."""
        with self._lock:
            ring = self._rings.get(principal)
            if ring is None:
                return 0, 0, []
            head = ring.head
            first = min(max(seq, head - self.capacity, 0), head)
            n = min(head - first, limit)
            keys = []
            for s in range(first, first + n):
                at = (s % self.capacity) * KEY_SIZE
                keys.append(bytes(ring.buf[at : at + KEY_SIZE]))
            return first, head, keys

    # -- wiring to a store ------------------------------------------------------------
    def watch(self, store: Any, tenants: Iterable[str] = ()) -> None:
        """Record what ``store`` drops: an :class:`~lmcache_backend_peer.shm.ArenaStore`
        (one arena per principal) or a :class:`~lmcache_backend_peer.store.FrameStore`.
        Without ``tenants`` the FrameStore holds the clients' keys as sent; with them
        (the server partitions the store) every principal's part, the shared secret's
        included, is under :func:`~lmcache_backend_peer.tenants.tenant_key`."""
        arenas = getattr(store, "arenas", None)
        if arenas is not None:
            for principal, arena in arenas.items():
                arena.on_drop = lambda key, p=principal: self.record(p, key)
            return
        self._tenants = tuple(tenants)
        store.on_drop = self._frame_dropped

    def _frame_dropped(self, stored: ChunkKey, frame: Any) -> None:
        """A FrameStore entry went: whose, and under which of its keys. The frame names
        the client's key (the node checked it on PUT); the stored key tells the
        principal (a stored key equal to the client's: written to the store directly,
        untenanted)."""
        if not self._tenants:
            self.record(None, stored)
            return
        try:
            info = FrameHeader.parse(frame)
            key = ChunkKey.parse(info.key)
        except (FrameError, ValueError):
            self.unattributed += 1
            return
        if key == stored:
            self.record(None, key)
            return
        for t in (None, *self._tenants):
            if tenant_key(t, key) == stored:
                self.record(t, key)
                return
        self.unattributed += 1
