"""The serving side: answers LOOKUP/GET (and, when writable, PUT/REMOVE) from a source.

One accept thread per listening socket plus one thread per connection. A new
connection takes one of its transport's ``max_unauthenticated`` slots (TCP and the
Unix socket each have their own; at most ``max_unauthenticated_per_address`` per
client address and ``max_unauthenticated_per_subnet`` per subnet or local user; when
full, room is made by fair share or the connection is closed at once) and must
authenticate within ``handshake_timeout``; only then does it count against
``max_connections`` (see :mod:`.limits`). Each request body is reserved against the node's
``max_inflight_bytes`` before it is allocated and must arrive within ``timeout`` of
its header; a body that cannot be reserved in that time is answered ERROR ("busy")
and the connection closed. An idle connection is dropped after ``idle_timeout``; but
once a request's first byte has arrived, the rest of its header must arrive within
``timeout`` (a half-sent header would otherwise hold a slot and a thread for the
whole ``idle_timeout``). A
malformed message closes the connection; a failing source answers ERROR. Nothing a
client sends can crash the server or make it hold more than ``max_inflight_bytes``
of request bodies (``max_frame_size`` per connection).

With ``tenants`` a connection that authenticates as tenant T sees only T's namespace
of the store (:mod:`.tenants`); the shared secret, if any, sees a namespace of its own
(no principal reads the store by raw keys).

With an ``eviction_log`` (:mod:`.evictions`) a client may ask EVICTIONS: what the
node dropped from its own principal's part since a sequence number.
"""

from __future__ import annotations

import logging
import errno
import os
import socket
import stat
import struct
import threading
import time
from typing import Any, Mapping

from lmcache_core.frames import FrameError, FrameHeader, FrameReader, FrameSeal

from .auth import Credentials, Principal, server_authenticate
from .connection import Connection, PeerTimeout
from .limits import Admission, ByteBudget, Origin, Slot, tcp_origin, unix_origin
from .protocol import (
    ERROR,
    EVICTIONS,
    EVICTIONS_OK,
    GET,
    GET_OK,
    KEY_SIZE,
    LOCATE,
    LOCATE_OK,
    LOOKUP,
    LOOKUP_OK,
    PUT,
    PUT_OK,
    REMOVE,
    MAX_KEYS_PER_MESSAGE,
    REMOVE_OK,
    SERVER_ID_SIZE,
    SHM_ATTACH,
    SHM_OK,
    TYPE_NAMES,
    EvictionsRequest,
    KeysRequest,
    PeerError,
    PutRequest,
    encode_evictions_reply,
    encode_get_reply_parts,
    encode_locate_reply,
    parse_body,
    u32,
)
from .evictions import EvictionLog
from .shm import Arena
from .store import ChunkSource
from .tenants import TenantSource

log = logging.getLogger(__name__)

Address = tuple[str, int]

KEYS_BODY_LIMIT = 4 + MAX_KEYS_PER_MESSAGE * KEY_SIZE
"""Largest LOOKUP/GET/REMOVE body; only PUT bodies may be larger."""


class PeerServer:
    """Serve ``source`` (a :class:`~lmcache_backend_peer.store.ChunkSource`) on
    ``listen`` to clients that know ``secret`` or a tenant's secret in ``tenants``.
    PUT and REMOVE are accepted only when ``writable`` (the source must then have
    ``put_frame``/``remove``). ``partition_tenants=False`` serves tenants the whole
    source (a server holding one tenant's chunks only, like a tier's own server).

    With ``unix_socket`` the server also listens on that path (mode 0600), with the
    same authentication (an existing file there is replaced only when it is a stale
    socket of ours, see :func:`_listen_unix`; :class:`SocketPathError` otherwise);
    when ``source`` is an :class:`~lmcache_backend_peer.shm.ArenaStore`, a client there may ask for its principal's arena (SHM_ATTACH, the fd comes by
    SCM_RIGHTS) and LOCATE keys in it (see :mod:`.shm`).

    With ``eviction_log`` (already watching ``source``) clients may ask EVICTIONS."""

    def __init__(
        self,
        source: ChunkSource,
        listen: Address,
        secret: bytes | None,
        *,
        tenants: Mapping[str, bytes] | None = None,
        partition_tenants: bool = True,
        writable: bool = False,
        max_frame_size: int = 256 << 20,
        timeout: float = 5.0,
        idle_timeout: float = 300.0,
        max_connections: int = 64,
        handshake_timeout: float = 1.0,
        max_unauthenticated: int = 32,
        max_unauthenticated_per_address: int = 4,
        max_unauthenticated_per_subnet: int | None = None,
        max_inflight_bytes: int | None = None,
        unix_socket: str | None = None,
        eviction_log: EvictionLog | None = None,
        seal: FrameSeal | None = None,
    ) -> None:
        if not secret and not tenants:
            raise ValueError("the shared secret must not be empty")
        inflight = max_inflight_bytes if max_inflight_bytes is not None else 2 * max_frame_size
        if writable and inflight < max_frame_size:
            raise ValueError(
                f"max_inflight_bytes ({inflight}) is below max_frame_size ({max_frame_size}): "
                "a PUT of the largest accepted frame could never be received; raise one or lower the other"
            )
        limits: tuple[int, ...] = (max_connections, max_unauthenticated, max_unauthenticated_per_address)
        limits += () if max_unauthenticated_per_subnet is None else (max_unauthenticated_per_subnet,)
        if min(limits) < 1 or handshake_timeout <= 0:
            raise ValueError("connection limits must be at least 1 and handshake_timeout positive")
        self.source: Any = source
        self.secret = secret
        self.credentials = Credentials(secret or None, dict(tenants or {}))
        self.partition_tenants = partition_tenants
        self.writable = writable
        self.max_frame_size = max_frame_size
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.admission = Admission(
            max_connections, max_unauthenticated, max_unauthenticated_per_address, max_unauthenticated_per_subnet
        )
        self.inflight = ByteBudget(inflight)
        self.server_id = os.urandom(SERVER_ID_SIZE)
        self.eviction_log = eviction_log
        #: the deployment's frame key, when the node has it: pushed frames must then
        #: be sealed with it. Without it, sealed frames are kept after the checks the
        #: node can make (header, key); the engines that read them check the MAC.
        self.seal = seal
        self.stats = {
            "connections": 0,
            "auth_failures": 0,
            "protocol_errors": 0,
            "requests": 0,
            "rejected": 0,
            "rejected_unauthenticated": 0,
            "evicted_unauthenticated": 0,
            "handshake_timeouts": 0,
            "busy": 0,
            # keys asked and held (LOOKUP: the held prefix; GET, LOCATE: each key)
            "lookup_keys": 0,
            "lookup_hits": 0,
            "get_keys": 0,
            "get_hits": 0,
            "locate_keys": 0,
            "locate_hits": 0,
        }
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
        self.unix_socket = unix_socket
        self._usock: socket.socket | None = None
        self._unix_ident = (0, 0)
        if unix_socket is not None:
            try:
                self._usock, self._unix_ident = _listen_unix(unix_socket)
            except OSError:
                self._sock.close()
                raise
        self._threads = [
            threading.Thread(target=self._accept_loop, args=(s,), name=f"lmcache-peer-accept-{self.address[1]}", daemon=True)
            for s in (self._sock, self._usock)
            if s is not None
        ]
        for t in self._threads:
            t.start()

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Stop accepting, drop every connection, join the accept thread. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for lsock in (self._sock, self._usock):
            if lsock is None:
                continue
            try:
                lsock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        self._sock.close()
        if self._usock is not None:
            # Checked while the socket is still open: it keeps its inode alive, so
            # no file made since can have been given the same inode number.
            _unlink_if_ours(str(self.unix_socket), self._unix_ident)
            self._usock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()

    def __enter__(self) -> "PeerServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self, lsock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            origin: Origin
            if sock.family == socket.AF_UNIX:
                origin = _unix_peer(sock)  # per process and per user on the local socket
                conn = Connection(sock, f"unix {origin.address}")
            else:
                origin = tcp_origin(addr[0])
                conn = Connection(sock, f"{addr[0]}:{addr[1]}")
            slot = self.admission.admit(origin, conn.close)
            if isinstance(slot, str):
                with self._lock:
                    self.stats["rejected_unauthenticated"] += 1
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
                self.stats["connections"] += 1
                self.stats["evicted_unauthenticated"] = self.admission.evictions
            threading.Thread(target=self._serve, args=(conn, slot), name="lmcache-peer-conn", daemon=True).start()

    # -- one connection ---------------------------------------------------------------
    def _count(self, stat: str) -> None:
        with self._lock:
            self.stats[stat] += 1

    def _count_hits(self, kind: str, asked: int, held: int) -> None:
        with self._lock:
            self.stats[f"{kind}_keys"] += asked
            self.stats[f"{kind}_hits"] += held

    def _serve(self, conn: Connection, slot: Slot) -> None:
        try:
            try:
                who = server_authenticate(conn, self.credentials, self.server_id, self.handshake_timeout)
            except PeerTimeout:
                if not slot.evicted:
                    self._count("handshake_timeouts")
                return
            if who is None:
                self._count("auth_failures")
                log.warning("peer server %s: client %s failed authentication", self.address, conn.peer)
                return
            if not self.admission.authenticated(slot):
                if slot.evicted:  # closed for a newcomer while it was answering
                    return
                self._count("rejected")
                self._refuse(conn, f"server is at max_connections ({self.max_connections}); try again later")
                return
            source = self._source_for(who)
            if source is None:
                self._refuse(conn, "no store for this principal on this node")
                return
            while not self._stop.is_set():
                # Idle between requests up to idle_timeout (pooled connections wait
                # here); once a request's first byte is in, the rest of its header must
                # follow within timeout, like its body.
                header = conn.recv_header(time.monotonic() + self.idle_timeout, self.max_frame_size, self.timeout)
                self._count("requests")
                admitted = self._admit_body(conn, header)
                if admitted is None:
                    continue
                if not admitted:
                    return
                try:
                    body = conn.recv_body(header, time.monotonic() + self.timeout)
                    self._handle(conn, header.type, header.request_id, body, source, who.tenant)
                    del body  # the buffer goes before its reservation does
                finally:
                    self.inflight.release(header.body_len)
        except PeerError as err:
            if not slot.evicted and not self._stop.is_set() and "closed" not in str(err):
                self._count("protocol_errors")
                log.debug("peer server %s: dropping %s: %s", self.address, conn.peer, err)
        except Exception:  # a bug must cost one connection, not the server
            log.exception("peer server %s: unexpected error on %s", self.address, conn.peer)
        finally:
            conn.close()
            self.admission.leave(slot)
            with self._lock:
                self._conns.discard(conn)

    def _source_for(self, who: Principal) -> Any:
        if hasattr(self.source, "arena_for"):  # an ArenaStore: one arena per principal
            return self.source.arena_for(who.tenant)
        # With tenants every principal, the shared secret's too, reads and writes the
        # store only through its own keyed namespace: no raw key reaches a tenant's.
        if not self.partition_tenants or not self.credentials.tenants:
            return self.source
        return TenantSource(self.source, who.tenant)

    def _refuse(self, conn: Connection, message: str, rid: int = 0) -> None:
        """Best-effort ERROR before the caller closes the connection."""
        try:
            conn.send(ERROR, rid, [message.encode()[:1000]], time.monotonic() + min(self.timeout, 1.0))
        except PeerError:
            pass

    def _admit_body(self, conn: Connection, header: Any) -> bool | None:
        """Whether the body announced by ``header`` may be read: within the limit for
        its type, and reserved against the in-flight budget (waiting at most
        ``timeout``). On False the client got an ERROR; the connection must close
        (the unread body would otherwise be taken for the next message). None: the
        request was answered already (a PUT to a read-only server)."""
        name = TYPE_NAMES.get(header.type, str(header.type))
        if header.type == PUT and not self.writable:
            # Stepped over through a 64 KiB scratch buffer, never held: the client
            # gets its ERROR and keeps a usable connection, as for any refusal.
            conn.discard(header.body_len, time.monotonic() + self.timeout)
            conn.send(ERROR, header.request_id, [b"this peer is read-only"], time.monotonic() + self.timeout)
            return None
        limit = self.max_frame_size if header.type == PUT else KEYS_BODY_LIMIT
        if header.body_len > limit:
            self._count("protocol_errors")
            self._refuse(conn, f"{name} body of {header.body_len} bytes exceeds the limit of {limit}", header.request_id)
            return False
        if not self.inflight.acquire(header.body_len, time.monotonic() + self.timeout):
            self._count("busy")
            log.info(
                "peer server %s: %s from %s refused: in-flight budget of %d bytes is in use",
                self.address,
                name,
                conn.peer,
                self.inflight.total,
            )
            self._refuse(
                conn,
                f"busy: {name} body of {header.body_len} bytes does not fit the node's in-flight "
                f"budget ({self.inflight.total} bytes) now; retry later",
                header.request_id,
            )
            return False
        return True

    def _handle(self, conn: Connection, mtype: int, rid: int, body: memoryview, source: Any, principal: str | None) -> None:
        deadline = time.monotonic() + self.timeout
        msg = parse_body(mtype, body)
        try:
            if mtype == LOOKUP and isinstance(msg, KeysRequest):
                held = source.contains(msg.keys)
                self._count_hits("lookup", len(msg.keys), held)
                conn.send(LOOKUP_OK, rid, [u32(held)], deadline)
            elif mtype == GET and isinstance(msg, KeysRequest):
                held = self._reserve_reply(msg, source, len(body)) if isinstance(source, Arena) else 0
                if held is None:
                    conn.send(
                        ERROR, rid, [b"busy: the reply does not fit the node's in-flight budget now; retry later"], deadline
                    )
                    return
                try:
                    frames = self._frames_for(msg, source, held or None)
                    self._count_hits("get", len(msg.keys), sum(f is not None for f in frames))
                    conn.send(GET_OK, rid, encode_get_reply_parts(frames), deadline)
                    del frames
                finally:
                    if held:
                        self.inflight.release(held)
            elif mtype == PUT and isinstance(msg, PutRequest):
                if not self.writable:
                    conn.send(ERROR, rid, [b"this peer is read-only"], deadline)
                else:
                    conn.send(PUT_OK, rid, [b"\x01" if self._put(msg, source) else b"\x00"], deadline)
            elif mtype == LOCATE and isinstance(msg, KeysRequest):
                if not (conn.local and isinstance(source, Arena)):
                    conn.send(ERROR, rid, [b"LOCATE needs shared memory (the node's Unix socket, arenas on)"], deadline)
                else:
                    locs = source.locate(msg.keys)
                    self._count_hits("locate", len(msg.keys), sum(x is not None for x in locs))
                    entries = [(0, 0, 0) if x is None else (x.offset, x.length, x.generation) for x in locs]
                    conn.send(LOCATE_OK, rid, [encode_locate_reply(entries)], deadline)
            elif mtype == SHM_ATTACH:
                if not (conn.local and isinstance(source, Arena)):
                    why = "connect to the node's Unix socket" if not conn.local else "shared memory is off on this node"
                    conn.send(ERROR, rid, [f"no shared memory here: {why}".encode()], deadline)
                else:
                    conn.send_fd(SHM_OK, rid, [source.size.to_bytes(8, "big")], source.fd, deadline)
            elif mtype == EVICTIONS and isinstance(msg, EvictionsRequest):
                if self.eviction_log is None:
                    conn.send(ERROR, rid, [b"this node keeps no eviction log"], deadline)
                else:
                    first, head, keys = self.eviction_log.since(principal, msg.since)
                    conn.send(EVICTIONS_OK, rid, [encode_evictions_reply(first, head, keys)], deadline)
            elif mtype == REMOVE and isinstance(msg, KeysRequest):
                if not self.writable:
                    conn.send(ERROR, rid, [b"this peer is read-only"], deadline)
                else:
                    conn.send(REMOVE_OK, rid, [u32(sum(1 for k in msg.keys if source.remove(k)))], deadline)
            else:
                conn.send(ERROR, rid, [f"unexpected message type {mtype}".encode()], deadline)
        except PeerError:
            raise
        except Exception as err:
            log.warning("peer server %s: source failed: %s: %s", self.address, type(err).__name__, err)
            conn.send(ERROR, rid, [f"server error: {type(err).__name__}".encode()], deadline)

    def _reserve_reply(self, req: KeysRequest, arena: Arena, body_len: int) -> int | None:
        """An arena's frames are copied out of its mapping for the socket, and held
        until the reply is sent: their bytes (what the frames take now, at most
        ``max_frame_size`` and the budget) are reserved in flight as a request body is, so a node's
        memory stays within ``max_inflight`` however many clients stall reading their
        replies. The bytes reserved (0: nothing held), or None when they do not fit
        within half the request's deadline (the other half is for the answer). The
        request's own body (``body_len``) is still reserved meanwhile."""
        cap = min(self.max_frame_size, self.inflight.total - body_len)  # a longer reply is cut: the client asks on
        n = 4
        for loc in arena.locate(req.keys):
            n += 8 + (loc.length if loc is not None else 0)
            if n >= cap:
                n = cap
                break
        if n <= 4 + 8 * len(req.keys):
            return 0  # nothing held: a reply of misses
        return n if self.inflight.acquire(n, time.monotonic() + self.timeout / 2) else None

    def _frames_for(self, req: KeysRequest, source: Any, limit: int | None = None) -> list[bytes | memoryview | None]:
        """Frames in request order until the reply would pass ``max_frame_size`` (or
        ``limit``: the bytes reserved for it); a frame that alone is too large is
        answered as a miss."""
        budget = (self.max_frame_size if limit is None else limit) - 4
        frames: list[bytes | memoryview | None] = []
        for k in req.keys:
            f = source.get_frame(k)
            size = 8 + (memoryview(f).nbytes if f is not None else 0)
            if size > budget:
                if frames:
                    break
                f, size = None, 8
            frames.append(f)
            budget -= size
        return frames

    def _put(self, req: PutRequest, source: Any) -> bool:
        """Keep a pushed frame only if it is whole: the header names the key and the
        payload matches the checksum, or the MAC when the node has the frame secret
        (a sealed frame the node cannot check is kept: its readers check it)."""
        try:
            info = FrameHeader.parse(req.frame)
            if self.seal is not None or not info.sealed:
                FrameReader(seal=self.seal).verify(info, info.payload(req.frame))
        except FrameError:
            return False
        if info.key != req.key.to_str():
            return False
        return bool(source.put_frame(req.key, req.frame if isinstance(source, Arena) else bytes(req.frame)))


def _unix_peer(sock: socket.socket) -> Origin:
    """The process and user at the other end (SO_PEERCRED), for admission."""
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return unix_origin(None, None)
    return unix_origin(pid, uid)


class SocketPathError(OSError):
    """The ``unix_socket`` path cannot be used safely; the message names the path and
    says why (nothing at the path was removed or followed)."""


_BIND_TRIES = 3
_PROBE_TIMEOUT = 0.5


def _listen_unix(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """A listening Unix socket at ``path``, mode 0600 (owner only), and the identity
    (device, inode) of the file it made, so that :func:`_unlink_if_ours` removes that
    file and nothing else.

    The path may have been created first by someone else (another local user, or a
    stale file), so nothing there is trusted:

    * ``bind`` itself creates the file, and fails on any existing name: it never
      replaces or follows what is there (a symbolic link included);
    * the umask is 0177 around it, so the socket is 0600 from the start, never wider;
    * an existing name is replaced only when it is a stale socket of ours: a socket
      file (``lstat``, not followed), owned by this process's user, that refuses a
      connect. A live socket, a symbolic link, a regular file, FIFO or directory, or a
      file of another user is refused with :class:`SocketPathError`, left as it is;
    * the directory must not be writable by everyone without the sticky bit (then
      any local user could rename our socket away and put theirs in its place);
    * after binding, ``lstat`` checks that the name is our socket, owned by us,
      mode 0600.
    """
    _check_directory(path)
    for _ in range(_BIND_TRIES):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind_owner_only(sock, path)
        except OSError as err:
            sock.close()
            if err.errno != errno.EADDRINUSE:
                raise SocketPathError(f"{path}: cannot bind: {err.strerror or err}") from None
            _remove_stale(path)  # raises unless a stale socket of ours was removed
            continue
        try:
            ident = _check_bound(path)
            sock.listen(128)
            sock.settimeout(0.2)
        except BaseException:
            sock.close()
            raise
        return sock, ident
    raise SocketPathError(f"{path}: a socket kept reappearing there while a stale one was replaced; is another node starting?")


def _bind_owner_only(sock: socket.socket, path: str) -> None:
    """Bind with the umask at 0177: the file is created 0600, with no moment wider
    (unless a default ACL on the directory overrides the umask: :func:`_check_bound`
    narrows the mode then)."""
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)


def _check_directory(path: str) -> None:
    """Refuse a directory that lets any local user replace the socket."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(parent)
    except OSError as err:
        raise SocketPathError(f"{path}: cannot use its directory {parent}: {err.strerror or err}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"{path}: {parent} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise SocketPathError(
            f"{path}: its directory {parent} is writable by every user without the sticky bit, so anyone could "
            "replace the socket; use a directory only the node's user can write (e.g. /run/lmcache) or one with "
            "the sticky bit (like /tmp)"
        )


def _describe(st: os.stat_result) -> str:
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(st.st_mode):
            return name
    return "a file of an unknown kind"


def _remove_stale(path: str) -> None:
    """Remove what is at ``path`` if it is a stale socket of ours (see
    :func:`_listen_unix`); otherwise raise :class:`SocketPathError` saying what is
    there, and leave it. Gone already: nothing to do (the caller binds again)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise SocketPathError(f"{path}: cannot inspect it: {err.strerror or err}") from None
    keep = "left in place; remove it or choose another path"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise SocketPathError(f"{path} is a symbolic link (to {target}), not a socket: never followed, {keep}")
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is {_describe(st)}, not a socket: {keep}")
    if st.st_uid != os.geteuid():
        raise SocketPathError(
            f"{path} is a socket owned by uid {st.st_uid}, not by this node's user (uid {os.geteuid()}): {keep}"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(_PROBE_TIMEOUT)
        probe.connect(path)
    except ConnectionRefusedError:
        pass  # stale: nobody listens on it (its node is gone)
    except socket.timeout:
        raise SocketPathError(f"{path}: a process holds this socket but does not accept connections: {keep}") from None
    except OSError as err:
        raise SocketPathError(f"{path}: cannot tell whether this socket is in use ({err.strerror or err}): {keep}") from None
    else:
        raise SocketPathError(f"another node is listening on {path} (or another process is): stop it or choose another path")
    finally:
        probe.close()
    try:
        again = os.lstat(path)
        if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):  # still the file we judged
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise SocketPathError(f"{path}: cannot remove the stale socket: {err.strerror or err}") from None
    log.info("peer server: replaced the stale socket %s (nobody was listening on it)", path)


def _check_bound(path: str) -> tuple[int, int]:
    """(device, inode) of the socket just bound at ``path``, once ``lstat`` shows our
    socket, mode 0600."""
    try:
        st = os.lstat(path)
    except OSError as err:
        raise SocketPathError(f"{path}: gone right after binding: {err.strerror or err}") from None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise SocketPathError(f"{path}: replaced by something else right after binding; refusing to use it")
    if stat.S_IMODE(st.st_mode) != 0o600:
        # The umask did not apply (a default ACL on the directory): narrow it now, on
        # the file lstat just checked (it is a socket, not a link).
        os.chmod(path, 0o600)
    return st.st_dev, st.st_ino


def _unlink_if_ours(path: str, ident: tuple[int, int]) -> None:
    """Remove ``path`` if it is still the socket this server made (same device and
    inode); anything put there since stays."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if (st.st_dev, st.st_ino) != ident:
        log.warning("peer server: left %s in place: it is no longer the socket this node made", path)
        return
    try:
        os.unlink(path)
    except OSError:
        pass
