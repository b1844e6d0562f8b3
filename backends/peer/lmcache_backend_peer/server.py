"""The serving side: answers LOOKUP/GET (and, when writable, PUT/REMOVE) from a source.

One accept thread plus one thread per connection (bounded by ``max_connections``;
extra connections are closed at once). A connection must authenticate within the
handshake timeout before any request is read. Each request body must arrive within
``timeout`` of its header; an idle connection is dropped after ``idle_timeout``. A
malformed message closes the connection; a failing source answers ERROR. Nothing a
client sends can crash the server or make it allocate past ``max_frame_size``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from lmcache_core.serde import FrameError, parse_header

from .auth import server_handshake
from .connection import Connection
from .protocol import (
    ERROR,
    GET,
    GET_OK,
    LOOKUP,
    LOOKUP_OK,
    PUT,
    PUT_OK,
    REMOVE,
    REMOVE_OK,
    SERVER_ID_SIZE,
    KeysRequest,
    PeerError,
    PutRequest,
    encode_get_reply_parts,
    parse_body,
    u32,
)
from .store import ChunkSource

log = logging.getLogger(__name__)

Address = tuple[str, int]


class PeerServer:
    """Serve ``source`` (a :class:`~lmcache_backend_peer.store.ChunkSource`) on
    ``listen`` to clients that know ``secret``. PUT and REMOVE are accepted only when
    ``writable`` (the source must then have ``put_frame``/``remove``)."""

    def __init__(
        self,
        source: ChunkSource,
        listen: Address,
        secret: bytes,
        *,
        writable: bool = False,
        max_frame_size: int = 256 << 20,
        timeout: float = 5.0,
        idle_timeout: float = 300.0,
        max_connections: int = 64,
    ) -> None:
        if not secret:
            raise ValueError("the shared secret must not be empty")
        self.source: Any = source
        self.secret = secret
        self.writable = writable
        self.max_frame_size = max_frame_size
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.server_id = os.urandom(SERVER_ID_SIZE)
        self.stats = {"connections": 0, "auth_failures": 0, "protocol_errors": 0, "requests": 0, "rejected": 0}
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        self._stop = threading.Event()
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(listen)
            self._sock.listen(128)
            self._sock.settimeout(0.2)
        except OSError:
            self._sock.close()
            raise
        self.address: Address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name=f"lmcache-peer-accept-{self.address[1]}", daemon=True)
        self._thread.start()

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Stop accepting, drop every connection, join the accept thread. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()

    def __enter__(self) -> "PeerServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            conn = Connection(sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    self.stats["rejected"] += 1
                    conn.close()
                    continue
                self._conns.add(conn)
                self.stats["connections"] += 1
            threading.Thread(target=self._serve, args=(conn,), name="lmcache-peer-conn", daemon=True).start()

    # -- one connection ---------------------------------------------------------------
    def _serve(self, conn: Connection) -> None:
        try:
            if not server_handshake(conn, self.secret, self.server_id, self.timeout):
                self.stats["auth_failures"] += 1
                log.warning("peer server %s: client %s failed authentication", self.address, conn.peer)
                return
            while not self._stop.is_set():
                header, body = conn.recv(time.monotonic() + self.idle_timeout, self.max_frame_size, self.timeout)
                self.stats["requests"] += 1
                self._handle(conn, header.type, header.request_id, body)
        except PeerError as err:
            if not self._stop.is_set() and "closed" not in str(err):
                self.stats["protocol_errors"] += 1
                log.debug("peer server %s: dropping %s: %s", self.address, conn.peer, err)
        except Exception:  # a bug must cost one connection, not the server
            log.exception("peer server %s: unexpected error on %s", self.address, conn.peer)
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)

    def _handle(self, conn: Connection, mtype: int, rid: int, body: memoryview) -> None:
        deadline = time.monotonic() + self.timeout
        msg = parse_body(mtype, body)
        try:
            if mtype == LOOKUP and isinstance(msg, KeysRequest):
                conn.send(LOOKUP_OK, rid, [u32(self.source.contains(msg.keys))], deadline)
            elif mtype == GET and isinstance(msg, KeysRequest):
                conn.send(GET_OK, rid, encode_get_reply_parts(self._frames_for(msg)), deadline)
            elif mtype == PUT and isinstance(msg, PutRequest):
                if not self.writable:
                    conn.send(ERROR, rid, [b"this peer is read-only"], deadline)
                else:
                    conn.send(PUT_OK, rid, [b"\x01" if self._put(msg) else b"\x00"], deadline)
            elif mtype == REMOVE and isinstance(msg, KeysRequest):
                if not self.writable:
                    conn.send(ERROR, rid, [b"this peer is read-only"], deadline)
                else:
                    conn.send(REMOVE_OK, rid, [u32(sum(1 for k in msg.keys if self.source.remove(k)))], deadline)
            else:
                conn.send(ERROR, rid, [f"unexpected message type {mtype}".encode()], deadline)
        except PeerError:
            raise
        except Exception as err:
            log.warning("peer server %s: source failed: %s: %s", self.address, type(err).__name__, err)
            conn.send(ERROR, rid, [f"server error: {type(err).__name__}".encode()], deadline)

    def _frames_for(self, req: KeysRequest) -> list[bytes | memoryview | None]:
        """Frames in request order until the reply would pass ``max_frame_size``; a
        frame that alone is too large is answered as a miss."""
        budget = self.max_frame_size - 4
        frames: list[bytes | memoryview | None] = []
        for k in req.keys:
            f = self.source.get_frame(k)
            size = 8 + (memoryview(f).nbytes if f is not None else 0)
            if size > budget:
                if frames:
                    break
                f, size = None, 8
            frames.append(f)
            budget -= size
        return frames

    def _put(self, req: PutRequest) -> bool:
        try:
            info, _, _ = parse_header(req.frame)
        except FrameError:
            return False
        if info.key != req.key.to_str():
            return False
        return bool(self.source.put_frame(req.key, bytes(req.frame)))
