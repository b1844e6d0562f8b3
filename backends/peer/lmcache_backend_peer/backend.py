"""The ``peer`` tier: keep what is put here, serve it to peers, and ask peers on a miss.

The engine writes every stored chunk through to every tier, so this tier's own
:class:`FrameStore` holds exactly what this instance stored (within ``max_size``,
LRU); with ``listen`` it is served to the other instances. ``contains`` and ``get``
look in the local store first, then ask the peers (batched lookups; a key's holder
is remembered from ``contains`` to route the ``get``). With ``push`` every put and
remove is also sent to the peers (a shared cache node).

Failure rule: a peer that is down, slow, speaks garbage or sends a corrupt frame is a
miss for that request, and is then skipped for ``retry_after`` seconds so a dead
peer does not cost a timeout on every lookup. Frames are decoded with
``expect_key``: data for another key is never written into ``out``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence, TypeVar

import torch

from lmcache_core.backend import SHARED, BackendStats, StorageBackend
from lmcache_core.keys import ChunkKey
from lmcache_core.serde import Codec, encode, try_decode

from .client import PeerClient, PeerRequestError
from .protocol import PeerError
from .server import PeerServer
from .store import FrameStore

log = logging.getLogger(__name__)

ROUTE_CACHE_SIZE = 65536
T = TypeVar("T")


class _Peer:
    __slots__ = ("client", "down_until", "is_self")

    def __init__(self, client: PeerClient) -> None:
        self.client = client
        self.down_until = 0.0
        self.is_self = False


class PeerBackend(StorageBackend):
    name = "peer"
    capabilities = frozenset({SHARED})

    def __init__(
        self,
        store: FrameStore,
        clients: Sequence[PeerClient],
        *,
        codec: Codec,
        codecs: dict[str, Codec],
        server: PeerServer | None = None,
        push: bool = False,
        retry_after: float = 1.0,
    ) -> None:
        self.store = store
        self.server = server
        self.codec = codec
        self.codecs = dict(codecs)
        self.push = push
        self.retry_after = retry_after
        self._peers = [_Peer(c) for c in clients]
        self._routes: OrderedDict[ChunkKey, _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = BackendStats(self.name, bytes_capacity=store.max_size)
        self._closed = False

    # -- peers ----------------------------------------------------------------------
    def _live_peers(self) -> list[_Peer]:
        now = time.monotonic()
        return [p for p in self._peers if not p.is_self and p.down_until <= now]

    def _call(self, peer: _Peer, op: str, fn: Callable[..., T], *args: Any) -> T | None:
        """Run one request; on failure count it, mark the peer down (unless it merely
        refused), return None."""
        try:
            result = fn(*args)
        except PeerError as err:
            with self._lock:
                self._stats.errors += 1
            if not isinstance(err, PeerRequestError):
                peer.down_until = time.monotonic() + self.retry_after
            log.info("peer %s: %s failed, treated as a miss: %s", peer.client.name, op, err)
            return None
        if self.server is not None and peer.client.server_id == self.server.server_id:
            peer.is_self = True  # configured with our own address: never ask ourselves
            return None
        return result

    def _route(self, keys: Sequence[ChunkKey], peer: _Peer) -> None:
        with self._lock:
            for k in keys:
                self._routes[k] = peer
                self._routes.move_to_end(k)
            while len(self._routes) > ROUTE_CACHE_SIZE:
                self._routes.popitem(last=False)

    # -- contract ---------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        keys = list(keys)
        pos = self.store.contains(keys)
        while pos < len(keys):
            best, best_peer = 0, None
            for peer in self._live_peers():
                n = self._call(peer, "lookup", peer.client.lookup, keys[pos:])
                if n and n > best:
                    best, best_peer = n, peer
                    if pos + n == len(keys):
                        break
            if best_peer is None:
                local = self.store.contains(keys[pos:])
                if local == 0:
                    break
                pos += local
                continue
            self._route(keys[pos : pos + best], best_peer)
            pos += best
        return pos

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        frame = encode(key, data, self.codec)
        stored = self.store.put_frame(key, frame) if self.store.max_size else False
        if self.push:
            for peer in self._live_peers():
                if self._call(peer, "put", peer.client.put, key, frame):
                    stored = True
        with self._lock:
            if stored:
                self._stats.puts += 1
                self._stats.put_bytes += data.nbytes
            else:
                self._stats.skipped += 1
        return stored

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        frame = self.store.get_frame(key)
        if frame is not None:
            if self._decode(key, frame, out, "local store"):
                return True
            self.store.remove(key)
        with self._lock:
            routed = self._routes.get(key)
        candidates = self._live_peers()
        if routed is not None and routed in candidates:
            candidates.remove(routed)
            candidates.insert(0, routed)
        for peer in candidates:
            hit = [False]

            def sink(_: int, frame: memoryview | None, peer: _Peer = peer, hit: list[bool] = hit) -> None:
                hit[0] = frame is not None and self._decode(key, frame, out, peer.client.name)

            self._call(peer, "get", peer.client.fetch, [key], sink)
            if hit[0]:
                return True
        with self._lock:
            self._stats.misses += 1
        return False

    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> int:
        """Fill ``outs[i]`` with ``keys[i]``, one batched GET per peer round; returns
        the count of leading chunks filled (like the engine's retrieve)."""
        keys = list(keys)
        done = [False] * len(keys)
        for i, k in enumerate(keys):
            frame = self.store.get_frame(k)
            if frame is not None and self._decode(k, frame, outs[i], "local store"):
                done[i] = True
        for peer in self._live_peers():
            todo = [i for i, d in enumerate(done) if not d]
            if not todo:
                break

            def sink(j: int, frame: memoryview | None, peer: _Peer = peer, todo: list[int] = todo) -> None:
                i = todo[j]
                if frame is not None and self._decode(keys[i], frame, outs[i], peer.client.name):
                    done[i] = True

            self._call(peer, "get", peer.client.fetch, [keys[i] for i in todo], sink)
        n = 0
        while n < len(done) and done[n]:
            n += 1
        return n

    def _decode(self, key: ChunkKey, frame: bytes | memoryview, out: torch.Tensor, where: str) -> bool:
        _, reason = try_decode(frame, self.codecs, expect_key=key, out=out)
        with self._lock:
            if reason is None:
                self._stats.hits += 1
                self._stats.get_bytes += out.nbytes
                return True
            self._stats.errors += 1
        log.info("peer tier: chunk %s from %s rejected: %s", key, where, reason)
        return False

    def remove(self, key: ChunkKey) -> bool:
        removed = self.store.remove(key)
        with self._lock:
            self._routes.pop(key, None)
        if self.push:
            for peer in self._live_peers():
                if self._call(peer, "remove", peer.client.remove, [key]):
                    removed = True
        return removed

    def stats(self) -> BackendStats:
        with self._lock:
            s = self._stats.snapshot()
        s.chunks = len(self.store)
        s.bytes_used = self.store.bytes_used
        s.evictions = self.store.evictions
        now = time.monotonic()
        s.extra["peers"] = {p.client.name: ("self" if p.is_self else "down" if p.down_until > now else "up") for p in self._peers}
        if self.server is not None:
            s.extra["listen"] = f"{self.server.address[0]}:{self.server.address[1]}"
            s.extra["server"] = dict(self.server.stats)
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.close()
        for p in self._peers:
            p.client.close()
        self.store.clear()
