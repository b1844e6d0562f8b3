"""The ``peer`` tier: keep what is put here, serve it to peers, and ask peers on a miss.

The engine writes every stored chunk through to every tier, so this tier's own
:class:`FrameStore` holds exactly what this instance stored (within ``max_size``,
LRU); with ``listen`` it is served to the other instances. ``contains`` and ``get``
look in the local store first, then ask the peers (batched lookups; a key's holder
is remembered from ``contains`` to route the ``get``). With ``push`` every put and
remove is also sent to the peers (a shared cache node).

Same host: a peer at a Unix socket path (``unix_socket``, a node's ``--unix-socket``)
is asked first and, with ``shm``, through shared memory (:mod:`.shm`): ``contains``
LOCATEs the keys in the tenant's read-only mapped arena (one request for the batch)
and remembers where they lie; ``get`` copies straight from the mapping, a slot
reused meanwhile costs one fresh LOCATE, then a miss. When the node offers no
shared memory the Unix socket carries the frames as TCP would. The same node
reached two ways (socket and TCP) is asked once: peers with the server id of an
earlier one are skipped.

What the tier drops reaches the engine's listeners (KV events for routers) through
:meth:`~lmcache_core.backend.StorageBackend.evicted`: the local store's LRU evictions,
and with ``push`` what the nodes dropped (evicted, or removed by any client),
asked every ``eviction_poll`` seconds on a background thread started when the engine
subscribes (:meth:`subscribe_evictions`, on its first listener; EVICTIONS, see
:mod:`.evictions`). A key counts as gone from the tier when one copy goes.

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
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

import torch

from lmcache_core.backend import BATCHED, SHARED, BackendStats, EraseMatch, EraseUnsupported, StorageBackend
from lmcache_core.keys import ChunkKey
from lmcache_core.frames import Codec, FrameReader, FrameWriter

from .client import PeerClient, PeerRequestError, PeerUnsupported
from .protocol import MAX_EVICTIONS_PER_REPLY, PeerError, ProtocolError
from .server import PeerServer
from .shm import SHM_SUPPORTED, Location, ShmUnavailable, ShmView
from .store import FrameStore

if TYPE_CHECKING:
    from .admin_cli import NodeAdmins

log = logging.getLogger(__name__)

ROUTE_CACHE_SIZE = 65536
EVICTION_REPLIES_PER_POLL = 16
"""EVICTIONS replies read from one node per poll (the rest waits for the next)."""
FIRST_CONTACT = (1 << 64) - 1
"""``since`` that asks a node only for its head (no keys)."""
T = TypeVar("T")


class _Peer:
    __slots__ = ("client", "down_until", "is_self", "shm", "shm_off", "ev_server", "ev_next", "ev_off")

    def __init__(self, client: PeerClient, shm: bool) -> None:
        self.client = client
        self.down_until = 0.0
        self.is_self = False
        self.shm: ShmView | None = None
        self.shm_off: str | None = None if shm and isinstance(client.address, str) else "not asked for"
        self.ev_server: bytes | None = None  # the node whose drop numbers ev_next counts
        self.ev_next = 0
        self.ev_off: bytes | None = None  # server id of a node without EVICTIONS


class PeerBackend(StorageBackend):
    name = "peer"
    capabilities = frozenset({SHARED, BATCHED})

    def __init__(
        self,
        store: FrameStore,
        clients: Sequence[PeerClient],
        *,
        codec: Codec,
        codecs: Mapping[str, Codec],
        server: PeerServer | None = None,
        push: bool = False,
        retry_after: float = 1.0,
        shm: bool = True,
        eviction_poll: float = 0.0,
        admins: NodeAdmins | None = None,
    ) -> None:
        self.store = store
        self.admins = admins
        self.server = server
        self.codec = codec
        self.codecs = dict(codecs)
        self.push = push
        self.retry_after = retry_after
        self._peers = [_Peer(c, shm and SHM_SUPPORTED) for c in clients]
        self._routes: OrderedDict[ChunkKey, _Peer] = OrderedDict()
        self._locs: OrderedDict[ChunkKey, tuple[_Peer, Location]] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = BackendStats(self.name, bytes_capacity=store.max_size)
        self._closed = False
        store.on_drop = lambda key, _frame: self.evicted(key)
        self.eviction_poll = eviction_poll
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def subscribe_evictions(self, callback: Callable[[ChunkKey], None]) -> None:
        """Called by the engine once someone listens (KV events on): only then poll the
        nodes. Each reachable node's position is read here, before the first store can
        reach it, so every drop from now on is reported (a node down now: from its first
        answer)."""
        super().subscribe_evictions(callback)
        if self.push and self.eviction_poll > 0 and self._peers and self._poller is None and not self._closed:
            try:
                self.poll_evictions()
            except Exception:  # never fail the engine's start-up over events
                log.exception("peer tier: first eviction poll failed")
            self._poller = threading.Thread(
                target=self._poll_loop, args=(self.eviction_poll,), name="lmcache-peer-evictions", daemon=True
            )
            self._poller.start()

    # -- peers ----------------------------------------------------------------------
    def _live_peers(self) -> list[_Peer]:
        """Peers to ask now, in order; a node already listed (same server id, e.g. its
        Unix socket and its TCP address) is asked once."""
        now = time.monotonic()
        seen: set[bytes] = set()
        live = []
        for p in self._peers:
            if p.is_self or p.down_until > now:
                continue
            sid = p.client.server_id
            if sid is not None:
                if sid in seen:
                    continue
                seen.add(sid)
            live.append(p)
        return live

    # -- shared memory ----------------------------------------------------------------
    def _shm_view(self, peer: _Peer) -> ShmView | None:
        """The peer's arena mapping (attached on first use, again after the node
        restarted), or None when this peer has no fast path."""
        if peer.shm_off is not None:
            return None
        view = peer.shm
        if view is None or view.server_id != peer.client.server_id:
            peer.shm = None  # a restarted node: drop the old mapping (its memory goes with the last reader)
            try:
                view = peer.client.attach_shm()
            except (PeerRequestError, ShmUnavailable) as err:
                peer.shm_off = str(err)
                log.warning("peer %s: no shared memory, its socket carries the data: %s", peer.client.name, err)
                return None
            peer.shm = view
        return view

    def _locate(self, peer: _Peer, keys: Sequence[ChunkKey]) -> tuple[ShmView, list[Location | None]] | None:
        """LOCATE ``keys`` on ``peer``'s arena: the view the locations are valid in."""
        view = self._shm_view(peer)
        if view is None:
            return None
        locs, sid = peer.client.locate(keys)
        if sid != view.server_id:
            view = self._shm_view(peer)  # the node restarted between the two
            if view is None or view.server_id != sid:
                return None
        return view, locs

    def _lookup(self, peer: _Peer, keys: Sequence[ChunkKey]) -> int:
        found = self._locate(peer, keys)
        if found is None:
            return peer.client.lookup(keys)
        _, locs = found
        n = 0
        while n < len(locs) and locs[n] is not None:
            n += 1
        with self._lock:
            for k, loc in zip(keys[:n], locs):
                assert loc is not None
                self._locs[k] = (peer, loc)
                self._locs.move_to_end(k)
            while len(self._locs) > ROUTE_CACHE_SIZE:
                self._locs.popitem(last=False)
        return n

    def _shm_fill(self, peer: _Peer, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool] | None:
        """Read ``keys`` from ``peer``'s arena into ``outs``: which were filled, or
        None when the peer has no fast path (the caller asks over the socket)."""
        view = self._shm_view(peer)
        if view is None:
            return None
        done = [False] * len(keys)
        with self._lock:
            known = [self._locs.pop(k, None) for k in keys]
        for i, k in enumerate(keys):
            entry = known[i]
            if entry is not None and entry[0] is peer:
                done[i] = self._shm_read(view, k, entry[1], outs[i], peer) is None
        again = [i for i, d in enumerate(done) if not d]
        if again:
            found = self._locate(peer, [keys[i] for i in again])
            if found is not None:
                view, locs = found
                for i, loc in zip(again, locs):
                    done[i] = loc is not None and self._shm_read(view, keys[i], loc, outs[i], peer) is None
        return done

    def _shm_read(self, view: ShmView, key: ChunkKey, loc: Location, out: torch.Tensor, peer: _Peer) -> str | None:
        why = view.read(key, loc, out, self.codecs)
        with self._lock:
            if why is None:
                self._stats.hits += 1
                self._stats.get_bytes += out.nbytes
                self._stats.add(shm_hits=1)
            elif why != "slot reused":
                self._stats.errors += 1
        if why is not None and why != "slot reused":
            log.info("peer tier: chunk %s in %s's shared memory rejected: %s", key, peer.client.name, why)
        return why

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

    # -- what the nodes dropped -------------------------------------------------------
    def _poll_loop(self, interval: float) -> None:
        while True:
            try:
                self.poll_evictions()
            except Exception:  # a bug must not end the polling
                log.exception("peer tier: eviction poll failed")
            if self._stop.wait(interval):
                return

    def poll_evictions(self) -> int:
        """Ask each live node what it dropped since the last poll and report those keys
        as evicted; returns how many were reported (the background thread calls it)."""
        return sum(self._poll_peer(p) for p in self._live_peers() if not self._stop.is_set())

    def _poll_peer(self, peer: _Peer) -> int:
        if peer.ev_off is not None and peer.ev_off == peer.client.server_id:
            return 0
        reported = 0
        for _ in range(EVICTION_REPLIES_PER_POLL):
            since = peer.ev_next if peer.ev_server is not None else FIRST_CONTACT
            try:
                reply, sid = peer.client.evictions(since)
            except (PeerUnsupported, PeerRequestError) as err:
                peer.ev_off = peer.client.server_id
                log.warning("peer %s: no eviction events from this node (its drops are not reported): %s", peer.client.name, err)
                return reported
            except PeerError as err:
                log.debug("peer %s: eviction poll failed: %s", peer.client.name, err)
                return reported
            if sid != peer.ev_server:
                if peer.ev_server is None:
                    peer.ev_next = reply.head  # first contact: from now on
                else:
                    peer.ev_next = 0  # a restarted node numbers from 0; what the old one held is gone unreported
                    with self._lock:
                        self._stats.add(node_restarts=1)
                    log.warning("peer %s: the node restarted; what this tier had there is gone (not reported)", peer.client.name)
                peer.ev_server = sid
                continue
            if reply.first < since:
                with self._lock:
                    self._stats.errors += 1
                log.info("peer %s: %s", peer.client.name, ProtocolError(f"EVICTIONS_OK from {reply.first}, asked {since}"))
                return reported
            if reply.first > since:
                missed = reply.first - since
                with self._lock:
                    self._stats.add(eviction_gap=missed)
                log.warning("peer %s: %d drops on the node were missed (its eviction log wrapped)", peer.client.name, missed)
            for key in reply.keys:
                self.evicted(key)
            reported += len(reply.keys)
            peer.ev_next = reply.first + len(reply.keys)
            if len(reply.keys) < MAX_EVICTIONS_PER_REPLY or peer.ev_next >= reply.head:
                break
        if reported:
            with self._lock:
                self._stats.add(node_drops_reported=reported)
        return reported

    # -- contract ---------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        keys = list(keys)
        pos = self.store.contains(keys)
        while pos < len(keys):
            best, best_peer = 0, None
            for peer in self._live_peers():
                n = self._call(peer, "lookup", self._lookup, peer, keys[pos:])
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
        frame = FrameWriter.encode(key, data, self.codec)
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
            filled = self._call(peer, "get", self._shm_fill, peer, [key], [out])
            if filled is not None:
                if filled[0]:
                    return True
                continue
            hit = [False]

            def sink(_: int, frame: memoryview | None, peer: _Peer = peer, hit: list[bool] = hit) -> None:
                hit[0] = frame is not None and self._decode(key, frame, out, peer.client.name)

            self._call(peer, "get", peer.client.fetch, [key], sink)
            if hit[0]:
                return True
        with self._lock:
            self._stats.misses += 1
        return False

    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``outs[i]`` with ``keys[i]``, one batched GET per peer round (shared
        memory where a node offers it); per key, True for a hit."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output tensors")
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
            filled = self._call(peer, "get", self._shm_fill, peer, [keys[i] for i in todo], [outs[i] for i in todo])
            if filled is not None:
                for i, f in zip(todo, filled):
                    done[i] = f
                continue

            def sink(j: int, frame: memoryview | None, peer: _Peer = peer, todo: list[int] = todo) -> None:
                i = todo[j]
                if frame is not None and self._decode(keys[i], frame, outs[i], peer.client.name):
                    done[i] = True

            # each frame is about its chunk's bytes: the client pipelines GETs of ~16 MiB of them
            self._call(peer, "get", peer.client.fetch, [keys[i] for i in todo], sink, [outs[i].nbytes for i in todo])
        with self._lock:
            self._stats.misses += done.count(False)
        return done

    def _decode(self, key: ChunkKey, frame: bytes | memoryview, out: torch.Tensor, where: str) -> bool:
        reason = FrameReader(self.codecs).decode(frame, key=key, out=out).reason
        with self._lock:
            if reason is None:
                self._stats.hits += 1
                self._stats.get_bytes += out.nbytes
                return True
            self._stats.errors += 1
        log.info("peer tier: chunk %s from %s rejected: %s", key, where, reason)
        return False

    def remove(self, key: ChunkKey) -> bool:
        removed = self.store.remove(key, report=False)
        with self._lock:
            self._routes.pop(key, None)
            self._locs.pop(key, None)
        if self.push:
            for peer in self._live_peers():
                if self._call(peer, "remove", peer.client.remove, [key]):
                    removed = True
        return removed

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """Erase through the nodes' admin API (``admin_urls``): the chunks live in their
        memory, and in this process's own ``listen`` store (also erased here)."""
        if self.admins is None:
            raise EraseUnsupported(
                "the chunks live in the cache nodes' memory: give the tier admin_urls and admin_token_file "
                "to erase through the nodes' admin API (or POST /erase there)"
            )
        n = self.admins.erase(match, dry_run=dry_run) + self.store.erase(match, dry_run=dry_run)
        if progress is not None:
            progress(n)
        return n

    def stats(self) -> BackendStats:
        with self._lock:
            s = self._stats.snapshot()
        s.chunks = len(self.store)
        s.bytes_used = self.store.bytes_used
        s.evictions = self.store.evictions
        now = time.monotonic()
        s.extra["peers"] = {p.client.name: ("self" if p.is_self else "down" if p.down_until > now else "up") for p in self._peers}
        s.extra["shm"] = {
            p.client.name: "mapped" if p.shm is not None else f"off: {p.shm_off}" if p.shm_off else "not yet"
            for p in self._peers
            if isinstance(p.client.address, str)
        }
        if self._poller is not None:
            s.extra["eviction_events"] = {
                p.client.name: "off" if p.ev_off is not None and p.ev_off == p.client.server_id else "on" for p in self._peers
            }
        if self.server is not None:
            s.extra["listen"] = f"{self.server.address[0]}:{self.server.address[1]}"
            s.extra["server"] = dict(self.server.stats)
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=10)
        if self.server is not None:
            self.server.close()
        for p in self._peers:
            p.client.close()
            p.shm = None
        self.store.clear()
