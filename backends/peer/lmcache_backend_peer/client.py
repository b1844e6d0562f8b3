"""The requesting side: one :class:`PeerClient` per remote peer, with a small pool of
authenticated connections reused across requests (thread-safe).

Every request runs against one deadline (``timeout`` from its start, connecting and
authenticating included); a connection that saw any error is closed, never reused,
so a half-read reply can never be mistaken for the next one. An ERROR reply leaves
the connection usable and raises :class:`PeerRequestError`.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from typing import Callable, Sequence, TypeVar

from lmcache_core.keys import ChunkKey

from .auth import client_handshake
from .shm import Location, ShmUnavailable, ShmView, decode_locations
from .connection import Connection, PeerClosed, PeerTimeout
from .protocol import (
    ERROR,
    EVICTIONS,
    EVICTIONS_OK,
    GET,
    GET_OK,
    LOCATE,
    LOCATE_OK,
    LOOKUP,
    LOOKUP_OK,
    MAX_KEYS_PER_MESSAGE,
    PUT,
    PUT_OK,
    REMOVE,
    REMOVE_OK,
    SHM_ATTACH,
    SHM_OK,
    TYPE_NAMES,
    Buffer,
    Count,
    ErrorReply,
    EvictionsReply,
    GetReply,
    LocateReply,
    PeerError,
    ProtocolError,
    PutReply,
    ShmOk,
    encode_keys,
    key_bytes,
    parse_body,
    u64,
)

Address = tuple[str, int]
T = TypeVar("T")

FETCH_REPLY_BYTES = 16 << 20
"""About how many bytes of frames one pipelined GET asks for (:meth:`PeerClient.fetch`)."""
FETCH_DEPTH = 2
"""Pipelined GETs in flight on one connection: the next is at the server while a reply
is read, and requests (a few KiB of keys) can never fill the socket buffers."""


def _byte_groups(n: int, sizes: Sequence[int] | None, limit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of ``n`` keys of at most ``limit`` bytes each (at least one key,
    at most MAX_KEYS_PER_MESSAGE); one run without ``sizes``."""
    if sizes is None or n == 0:
        return [(0, n)]
    groups: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, size in enumerate(sizes[:n]):
        if i > lo and (total + size > limit or i - lo >= MAX_KEYS_PER_MESSAGE):
            groups.append((lo, i))
            lo, total = i, 0
        total += size
    groups.append((lo, n))
    return groups


Consume = Callable[[object, Connection], T]


class PeerRequestError(PeerError):
    """The peer answered with an ERROR message."""


class _NothingAnswered(PeerClosed):
    """A pipelined GET's connection closed before any reply: safe to retry once."""


class PeerUnsupported(PeerError):
    """The node closed a fresh, authenticated connection on a request type it does not
    know (a node older than that request)."""


def format_address(addr: Address | str) -> str:
    if isinstance(addr, str):
        return f"unix:{addr}"
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PeerClient:
    """Talks to the peer at ``address`` (``(host, port)``, or the path of a node's Unix
    socket) with the shared ``secret``, or, with ``tenant``, as that tenant of a
    shared node with the tenant's own ``secret``."""

    def __init__(
        self,
        address: Address | str,
        secret: bytes,
        *,
        timeout: float = 2.0,
        connect_timeout: float = 0.5,
        max_frame_size: int = 256 << 20,
        pool_size: int = 4,
        tenant: str | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the shared secret must not be empty")
        self.address = address
        self.name = format_address(address)
        self.secret = secret
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_frame_size = max_frame_size
        self.pool_size = pool_size
        self.tenant = tenant
        self.server_id: bytes | None = None
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    # -- connections ----------------------------------------------------------------
    def _connect(self, deadline: float) -> Connection:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeout(f"{self.name}: timed out before connecting")
        try:
            if isinstance(self.address, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(min(self.connect_timeout, left))
                    sock.connect(self.address)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection(self.address, timeout=min(self.connect_timeout, left))
        except socket.timeout:
            raise PeerTimeout(f"{self.name}: connect timed out") from None
        except OSError as err:
            raise PeerClosed(f"{self.name}: cannot connect: {err}") from None
        conn = Connection(sock, self.name)
        try:
            self.server_id = conn.server_id = client_handshake(conn, self.secret, deadline, self.tenant)
        except BaseException:
            conn.close()
            raise
        return conn

    def _acquire(self, deadline: float) -> tuple[Connection, bool]:
        """A connection and whether it was reused from the pool."""
        with self._lock:
            if self._closed:
                raise PeerClosed(f"{self.name}: client is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(deadline), False

    def _release(self, conn: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def connect(self) -> bytes:
        """Open (and pool) one connection now; returns the server's instance id."""
        conn = self._connect(time.monotonic() + self.timeout)
        server_id = self.server_id
        self._release(conn)
        return server_id if server_id is not None else b""

    # -- requests -------------------------------------------------------------------
    def _request(self, mtype: int, parts: Sequence[Buffer], reply_type: int, consume: Consume[T] | None = None) -> object:
        """One request/reply. With ``consume``, the reply is read into the connection's
        reusable buffer and ``consume(reply, connection)`` runs before the connection
        goes back to the pool (so the views it sees are never overwritten under it)."""
        deadline = time.monotonic() + self.timeout
        while True:
            conn, reused = self._acquire(deadline)
            try:
                return self._exchange(conn, mtype, parts, reply_type, deadline, consume)
            except PeerClosed:
                # A pooled connection the server has since dropped: one fresh try.
                if not reused:
                    raise

    def _exchange(
        self,
        conn: Connection,
        mtype: int,
        parts: Sequence[Buffer],
        reply_type: int,
        deadline: float,
        consume: Consume[T] | None,
    ) -> object:
        rid = next(self._ids) & 0xFFFFFFFF
        ok = False
        try:
            conn.send(mtype, rid, parts, deadline)
            msg = self._reply(conn, rid, mtype, reply_type, deadline, reuse=consume is not None)
            if consume is None:
                ok = True
                return msg
            result = consume(msg, conn)
            ok = True
            return result
        except PeerRequestError:
            ok = True  # the server refused in good order: the connection is in step
            raise
        finally:
            if ok:
                self._release(conn)
            else:
                conn.close()

    def _reply(self, conn: Connection, rid: int, mtype: int, reply_type: int, deadline: float, *, reuse: bool) -> object:
        """Read and parse the reply to request ``rid``; an ERROR reply raises
        :class:`PeerRequestError`, anything else unexpected :class:`ProtocolError`."""
        header, body = conn.recv(deadline, self.max_frame_size, reuse=reuse)
        if header.request_id != rid:
            raise ProtocolError(f"{self.name}: reply to request {header.request_id}, expected {rid}")
        msg = parse_body(header.type, body)
        if header.type == ERROR and isinstance(msg, ErrorReply):
            raise PeerRequestError(f"{self.name}: {TYPE_NAMES[mtype]} refused: {msg.message}")
        if header.type != reply_type:
            raise ProtocolError(f"{self.name}: expected {TYPE_NAMES[reply_type]}, got {TYPE_NAMES[header.type]}")
        return msg

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, the peer holds."""
        n = 0
        for lo in range(0, len(keys), MAX_KEYS_PER_MESSAGE):
            batch = keys[lo : lo + MAX_KEYS_PER_MESSAGE]
            msg = self._request(LOOKUP, [encode_keys(batch)], LOOKUP_OK)
            if not isinstance(msg, Count) or msg.n > len(batch):
                raise ProtocolError(f"{self.name}: LOOKUP_OK count out of range")
            n += msg.n
            if msg.n < len(batch):
                break
        return n

    def get(self, keys: Sequence[ChunkKey]) -> list[memoryview | None]:
        """Frames for ``keys`` in order (None = the peer does not have it). Frames are
        unverified bytes: decode them with ``expect_key``."""
        out: list[memoryview | None] = []
        pos = 0
        while pos < len(keys):
            batch = keys[pos : pos + MAX_KEYS_PER_MESSAGE]
            msg = self._request(GET, [encode_keys(batch)], GET_OK)
            if not isinstance(msg, GetReply) or not 0 < len(msg.frames) <= len(batch):
                raise ProtocolError(f"{self.name}: GET_OK answered a wrong number of keys")
            out.extend(msg.frames)
            pos += len(msg.frames)
        return out

    def fetch(
        self,
        keys: Sequence[ChunkKey],
        sink: Callable[[int, memoryview | None], None],
        sizes: Sequence[int] | None = None,
    ) -> int:
        """Like :meth:`get`, without copies: ``sink(i, frame)`` is called for each
        answered key while the reply buffer is valid (the view must not be kept).
        Returns how many keys were answered (all of them, or it raises).

        With ``sizes`` (the most bytes each key's frame can have), the keys go out as
        requests of about :data:`FETCH_REPLY_BYTES` of replies each, pipelined on one
        connection (the next request is on its way while a reply is read), so each
        reply lands in the connection's reused buffer: one round trip for the batch,
        and memory for one request's reply instead of the whole batch's."""
        groups = _byte_groups(len(keys), sizes, FETCH_REPLY_BYTES)
        if len(groups) > 1:
            return self._fetch_pipelined(keys, groups, sink)
        pos = 0

        def consume(msg: object, _: Connection) -> int:
            if not isinstance(msg, GetReply) or not 0 < len(msg.frames) <= len(batch):
                raise ProtocolError(f"{self.name}: GET_OK answered a wrong number of keys")
            for i, f in enumerate(msg.frames):
                sink(pos + i, f)
            return len(msg.frames)

        while pos < len(keys):
            batch = keys[pos : pos + MAX_KEYS_PER_MESSAGE]
            pos += int(self._request(GET, [encode_keys(batch)], GET_OK, consume))  # type: ignore[call-overload]
        return pos

    def _fetch_pipelined(
        self, keys: Sequence[ChunkKey], groups: list[tuple[int, int]], sink: Callable[[int, memoryview | None], None]
    ) -> int:
        """:meth:`fetch` as one GET per group, at most :data:`FETCH_DEPTH` in flight. A
        reply that answers only part of its group (the server caps a reply's size)
        leaves the rest to a plain :meth:`fetch` afterwards."""
        deadline = time.monotonic() + self.timeout
        while True:
            conn, reused = self._acquire(deadline)
            try:
                answered, short = self._gets_in_flight(conn, keys, groups, sink, deadline)
                break
            except _NothingAnswered:
                if not reused:
                    raise
                # A pooled connection the server has since dropped: one fresh try.
        if short:
            rest = [keys[i] for i in short]
            answered += self.fetch(rest, lambda j, f: sink(short[j], f))
        return answered

    def _gets_in_flight(
        self,
        conn: Connection,
        keys: Sequence[ChunkKey],
        groups: list[tuple[int, int]],
        sink: Callable[[int, memoryview | None], None],
        deadline: float,
    ) -> tuple[int, list[int]]:
        """The pipelined GETs of :meth:`_fetch_pipelined` on ``conn``, which goes back
        to the pool only when every reply was read: ``(keys answered, keys left)``."""
        in_flight: list[tuple[int, int, int]] = []  # (request id, lo, hi), oldest first
        short: list[int] = []
        nxt = answered = 0
        done = False
        try:
            while nxt < len(groups) or in_flight:
                while nxt < len(groups) and len(in_flight) < FETCH_DEPTH:
                    lo, hi = groups[nxt]
                    rid = next(self._ids) & 0xFFFFFFFF
                    conn.send(GET, rid, [encode_keys(keys[lo:hi])], deadline)
                    in_flight.append((rid, lo, hi))
                    nxt += 1
                rid, lo, hi = in_flight.pop(0)
                msg = self._reply(conn, rid, GET, GET_OK, deadline, reuse=True)
                if not isinstance(msg, GetReply) or not 0 < len(msg.frames) <= hi - lo:
                    raise ProtocolError(f"{self.name}: GET_OK answered a wrong number of keys")
                for j, f in enumerate(msg.frames):
                    sink(lo + j, f)
                answered += len(msg.frames)
                short += range(lo + len(msg.frames), hi)
            done = True
        except PeerClosed as err:
            if answered == 0 and not short and not isinstance(err, _NothingAnswered):
                raise _NothingAnswered(str(err)) from err  # nothing handed over yet: the caller may retry
            raise
        finally:
            if done:
                self._release(conn)
            else:
                conn.close()  # replies may still be on their way: never pooled out of step
        return answered, short

    def put(self, key: ChunkKey, frame: Buffer) -> bool:
        """Push one frame; True when the peer stored it."""
        msg = self._request(PUT, [key_bytes(key), frame], PUT_OK)
        if not isinstance(msg, PutReply):
            raise ProtocolError(f"{self.name}: malformed PUT_OK")
        return msg.stored

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Drop keys on the peer; how many it had."""
        removed = 0
        for lo in range(0, len(keys), MAX_KEYS_PER_MESSAGE):
            batch = keys[lo : lo + MAX_KEYS_PER_MESSAGE]
            msg = self._request(REMOVE, [encode_keys(batch)], REMOVE_OK)
            if not isinstance(msg, Count):
                raise ProtocolError(f"{self.name}: malformed REMOVE_OK")
            removed += msg.n
        return removed

    # -- same-host shared memory (a node's Unix socket) ---------------------------------
    def attach_shm(self) -> ShmView:
        """This principal's arena on the node, mapped read-only. Raises
        :class:`PeerRequestError` when the node offers none, :class:`ShmUnavailable`
        when the fd is unusable, another :class:`PeerError` when the node is away."""
        if not isinstance(self.address, str):
            raise ShmUnavailable("shared memory needs the node's Unix socket")
        deadline = time.monotonic() + self.timeout
        conn = self._connect(deadline)
        rid = next(self._ids) & 0xFFFFFFFF
        ok = False
        fds: list[int] = []
        try:
            conn.send(SHM_ATTACH, rid, [], deadline)
            header, body, fds = conn.recv_fds(deadline, 1024)
            if header.request_id != rid:
                raise ProtocolError(f"{self.name}: reply to request {header.request_id}, expected {rid}")
            msg = parse_body(header.type, body)
            if isinstance(msg, ErrorReply):
                ok = True
                raise PeerRequestError(f"{self.name}: SHM_ATTACH refused: {msg.message}")
            if not isinstance(msg, ShmOk) or header.type != SHM_OK or len(fds) != 1:
                raise ProtocolError(f"{self.name}: expected SHM_OK with one fd, got {TYPE_NAMES[header.type]} and {len(fds)}")
            fd = fds.pop()
            ok = True
            return ShmView(fd, msg.size, conn.server_id)  # takes fd
        finally:
            for extra in fds:
                os.close(extra)
            if ok:
                self._release(conn)
            else:
                conn.close()

    def locate(self, keys: Sequence[ChunkKey]) -> tuple[list[Location | None], bytes]:
        """Where ``keys`` lie in this principal's arena, and the id of the node that
        answered (locations are only valid in that node's arena)."""
        out: list[Location | None] = []
        server = b""

        def consume(msg: object, conn: Connection) -> bytes:
            if not isinstance(msg, LocateReply) or len(msg.entries) != len(batch):
                raise ProtocolError(f"{self.name}: LOCATE_OK answered a wrong number of keys")
            out.extend(decode_locations(msg.entries))
            return conn.server_id

        for lo in range(0, len(keys), MAX_KEYS_PER_MESSAGE):
            batch = keys[lo : lo + MAX_KEYS_PER_MESSAGE]
            sid = self._request(LOCATE, [encode_keys(batch)], LOCATE_OK, consume)
            if server and sid != server:
                raise PeerClosed(f"{self.name}: the node restarted during a lookup")
            server = sid  # type: ignore[assignment]
        return out, server

    # -- what the node dropped (KV events) -------------------------------------------------
    def evictions(self, since: int) -> tuple[EvictionsReply, bytes]:
        """This principal's drops on the node numbered ``since`` and later (at most one
        reply's worth), and the id of the node that answered (numbers are only
        meaningful on that node). Raises :class:`PeerUnsupported` for a node that
        predates EVICTIONS, :class:`PeerRequestError` for one that keeps no log."""

        def consume(msg: object, conn: Connection) -> tuple[EvictionsReply, bytes]:
            if not isinstance(msg, EvictionsReply):
                raise ProtocolError(f"{self.name}: malformed EVICTIONS_OK")
            return msg, conn.server_id

        deadline = time.monotonic() + self.timeout
        conn, reused = self._acquire(deadline)
        if reused:
            try:
                return self._exchange(conn, EVICTIONS, [u64(since)], EVICTIONS_OK, deadline, consume)  # type: ignore[return-value]
            except PeerClosed:
                conn = self._connect(deadline)  # a pooled connection the node had dropped: one fresh try
        try:
            return self._exchange(conn, EVICTIONS, [u64(since)], EVICTIONS_OK, deadline, consume)  # type: ignore[return-value]
        except PeerClosed as err:
            # It authenticated us on this fresh connection, then hung up on the request.
            raise PeerUnsupported(f"{self.name}: the node does not answer EVICTIONS (older version?): {err}") from None
