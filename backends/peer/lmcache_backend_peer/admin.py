"""The node's admin HTTP API: ``lmcache-core serve --admin HOST:PORT --admin-token-file F``.

JSON over HTTP/1.1 (HTTPS with ``--admin-cert``/``--admin-key``), one request per
connection, standard library only (:mod:`http.server`):

- ``GET /status``: the node's store (bytes, chunks, evictions, budget), lookup/get/locate
  hit counts, connection counters, per-tenant usage on a node with tenants.
- ``POST /erase``: ``{"namespaces": ["<32 hex>", ...]}`` or ``{"all": true}``, optional
  ``"dry_run": true``: drops the matching chunks from the node's memory (the backend
  ``erase()`` contract, :class:`~lmcache_core.backend.EraseMatch`), whichever
  principal wrote them; or ``{"tenant": "<name>"}`` on a node with tenants: every
  chunk that tenant wrote, whatever its namespace, no other's. Answers how many went.
- ``GET /openapi.json``: this API described in OpenAPI 3.1 (:mod:`.openapi`).
- ``GET /metrics``: the status in Prometheus' text format (:mod:`.node_metrics`).
- ``GET /lookup?keys=K1,K2,...[&tenant=T]``: for chunk keys (``v1-<ns>-<hash>``, as
  engines name them), which the node holds for that principal (the shared secret's
  without ``tenant``). Read-only: it counts no hit and moves nothing in the LRU.
- ``POST /retain``: ``{"keys": [...], "seconds": S, "priority": P, "tenant": T}``:
  eviction passes over those chunks for S seconds (at most 30 days; a key not held
  yet from when it arrives), within a share of the store
  (:data:`~lmcache_backend_peer.store.RETAIN_SHARE`); ``POST /release`` ends it.

Secure by default. Every request must carry ``Authorization: Bearer <token>``, the
token read at start from ``--admin-token-file``: a regular file (no symbolic link)
owned by the node's user that group and others cannot access; anything else stops
the node with an error, and so does ``--admin`` without a token file, on loopback too
(every local user and every container sharing the network namespace reaches a
loopback port). A request with a missing or wrong token gets 401 before its body is
read or its path looked at; tokens are compared with :func:`hmac.compare_digest`.
Bounded: a request line of 64 KiB and 100 header lines (:mod:`http.server`'s own
limits), a body of :data:`MAX_BODY` (413 above it, never read), no chunked bodies
(411), :data:`MAX_CONNECTIONS` connections at once (more are closed at once), a rate
per client address (``rate`` requests a second, bursts of twice that; past it 429
with ``Retry-After``, before the token is looked at, so guessing tokens is as slow),
and the whole request, TLS handshake included, must arrive within ``timeout`` seconds
of the connection (a slow client is cut off then, whatever it has sent). No endpoint reads a
path or runs anything the client sends; each request is logged on stderr with the
client address, what it asked and the outcome.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
import socket
import ssl
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs, urlsplit

from lmcache_core.backend import EraseMatch
from lmcache_core.keys import HASH_BYTES, ChunkKey
from lmcache_core.namespaces import namespace_of
from lmcache_core.retention import MAX_PRIORITY
from lmcache_core.retention import MAX_SECONDS as MAX_RETAIN_S

from . import node_metrics
from .client import format_address
from .limits import MAX_BODY, MAX_ERASE_NAMESPACES, MAX_REQUEST_KEYS
from .openapi import SPEC
from .store import FrameStore
from .tenants import tenant_key

MAX_CONNECTIONS = 16
"""Admin connections served at once; one more is closed without an answer."""
TOKEN_MIN_CHARS = 16
TOKEN_MAX_BYTES = 4096
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RATE = 20.0
"""Admin requests a second per client address (``--admin-rate``); bursts of twice that."""
RATE_CLIENTS = 1024
"""Client addresses whose buckets are kept (the least recently seen go first)."""
LINGER_S = 1.0
LINGER_BYTES = 1 << 20
SHARED = "(shared secret)"
"""The label of the shared secret's principal in per-tenant usage."""


class AdminConfigError(ValueError):
    """The admin options cannot be used (the node does not start)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: Path) -> bytes:
    """The bearer token in ``path``: a regular file of this user that group and others
    cannot access, holding one token of at least :data:`TOKEN_MIN_CHARS` printable
    ASCII characters (surrounding whitespace is dropped). AdminConfigError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise AdminConfigError(f"cannot open {path}: {err.strerror or err} (a symbolic link is refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AdminConfigError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise AdminConfigError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise AdminConfigError(
                f"{path} has mode {mode:04o}: group or others can access it; make it private (chmod 600 {path})"
            )
        data = os.read(fd, TOKEN_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > TOKEN_MAX_BYTES:
        raise AdminConfigError(f"{path} is larger than {TOKEN_MAX_BYTES} bytes: not a token file")
    token = data.strip()
    if len(token) < TOKEN_MIN_CHARS or any(b <= 0x20 or b >= 0x7F for b in token):
        raise AdminConfigError(
            f"{path}: the token must be one word of at least {TOKEN_MIN_CHARS} printable ASCII characters "
            "(e.g. head -c 32 /dev/urandom | base64 > FILE)"
        )
    return token


def check_listen(host: str, token_file: Path | None) -> None:
    """AdminConfigError unless the admin API may listen on ``host`` with these options."""
    if token_file is None:
        where = "a loopback address is reachable by every local user" if is_loopback(host) else f"{host} is not loopback"
        raise AdminConfigError(f"--admin needs --admin-token-file ({where}; every request must carry the token)")


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """A server context for ``--admin-cert``/``--admin-key`` (both or neither), TLS 1.2+."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise AdminConfigError("give both --admin-cert and --admin-key, or neither")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as err:
        raise AdminConfigError(f"cannot load --admin-cert {cert} / --admin-key {key}: {err}") from None
    return ctx


class RateLimit:
    """Token buckets per client address: ``rate`` a second, at most ``2 * rate``
    saved up; ``rate`` 0: no limit. Thread-safe, bounded to :data:`RATE_CLIENTS`."""

    def __init__(self, rate: float) -> None:
        self.rate, self.burst = rate, max(1.0, 2 * rate)
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, when), oldest first
        self._lock = threading.Lock()

    def wait(self, address: str) -> float:
        """0 and one token taken if ``address`` may go on; else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens, then = self._buckets.pop(address, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            took = tokens >= 1.0
            self._buckets[address] = (tokens - 1.0 if took else tokens, now)
            while len(self._buckets) > RATE_CLIENTS:
                del self._buckets[next(iter(self._buckets))]
        return 0.0 if took else (1.0 - tokens) / self.rate


class _Refused(Exception):
    """A request answered with an error status (code, message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class AdminServer:
    """The admin API of ``node`` (a :class:`~lmcache_backend_peer.server.PeerServer`)
    serving ``store``, on ``listen``, for requests bearing ``token``."""

    def __init__(
        self,
        node: Any,
        store: Any,
        listen: tuple[str, int],
        token: bytes,
        *,
        tenants: Mapping[str, bytes] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: ssl.SSLContext | None = None,
        log: Any = None,
        rate: float = DEFAULT_RATE,
    ) -> None:
        if not token:
            raise ValueError("the admin token must not be empty")
        self.node = node
        self.store = store
        self.tenants = tuple(tenants or ())
        self._expected = b"Bearer " + token
        self.timeout = timeout
        self.tls = tls
        self.out = log if log is not None else sys.stderr
        self.started = time.monotonic()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.limit = RateLimit(rate)
        self.counts = {
            "requests": 0,
            "unauthorized": 0,
            "refused_busy": 0,
            "rate_limited": 0,
            "timeouts": 0,
            "erased_chunks": 0,
        }
        self._lock = threading.Lock()
        self.httpd = _HTTPServer(listen, self)
        self.address: tuple[str, int] = self.httpd.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="lmcache-node-admin", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{format_address(self.address)}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def audit(self, line: str) -> None:
        try:
            self.out.write(f"admin: {line}\n")
            self.out.flush()
        except (OSError, ValueError):
            pass

    def authorized(self, values: list[str]) -> bool:
        if len(values) != 1:
            return False
        try:
            given = values[0].strip().encode("latin-1")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(given, self._expected)

    # -- endpoints ------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        node, store = self.node, self.store
        with node._lock:
            stats = dict(node.stats)
        hits = {}
        for kind in ("lookup", "get", "locate"):
            asked, held = stats.pop(f"{kind}_keys", 0), stats.pop(f"{kind}_hits", 0)
            hits[kind] = {"keys": asked, "hits": held, "hit_rate": round(held / asked, 4) if asked else None}
        with self._lock:
            admin = dict(self.counts)
        return {
            "node": {
                "listen": format_address(node.address),
                "unix_socket": node.unix_socket,
                "writable": node.writable,
                "uptime_s": round(time.monotonic() - self.started, 1),
                "tenants": len(self.tenants),
            },
            "tiers": [
                {
                    "name": "node",
                    "kind": "shared-memory arenas" if hasattr(store, "arenas") else "memory",
                    "max_bytes": store.max_size,
                    "bytes": store.bytes_used,
                    "chunks": len(store),
                    "evictions": store.evictions,
                    **self.retained(),
                }
            ],
            "hits": hits,
            "connections": stats,
            "tenants": self.tenant_usage(),
            "quarantine": None,
            "admin": admin,
        }

    def retained(self) -> dict[str, int]:
        """Chunks and bytes retained now (every arena together on shared memory)."""
        parts = list(getattr(self.store, "arenas", {}).values()) or [self.store]
        stats = [p.retention_stats() for p in parts]
        return {k: sum(s[k] for s in stats) for k in ("retained", "retained_bytes")}

    def tenant_usage(self) -> dict[str, dict[str, int | None]] | None:
        """Per principal (None on a node without tenants): chunks and bytes held, its
        quota (``--tenant-quota``, a tenants-file ``quota=``; on shared memory its
        arena's size), puts refused and its own chunks evicted to stay within it."""
        if not self.tenants:
            return None
        arenas = getattr(self.store, "arenas", None)
        if arenas is not None:
            return {
                SHARED if p is None else p: {"chunks": len(a), "bytes": a.bytes_used, "quota": a.size} for p, a in arenas.items()
            }
        assert isinstance(self.store, FrameStore)
        usage = self.store.usage(owners=(None, *self.tenants))
        return {SHARED if p is None else p: row for p, row in usage.items()}

    def erase(self, body: Any) -> tuple[dict[str, Any], str]:
        if not isinstance(body, dict) or not set(body) <= {"namespaces", "all", "tenant", "dry_run"}:
            raise _Refused(
                400, 'expected {"namespaces": ["<id>", ...]}, {"tenant": "<name>"} or {"all": true}, optional "dry_run"'
            )
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool) or not isinstance(body.get("all", False), bool):
            raise _Refused(400, '"all" and "dry_run" must be true or false')
        given = [k for k in ("namespaces", "all", "tenant") if body.get(k) not in (None, False)]
        if len(given) != 1:
            raise _Refused(400, 'give exactly one of "namespaces" (a list of ids), "tenant" (a name) and "all": true')
        if given == ["tenant"]:
            tenant = body["tenant"]
            if not self.tenants:
                raise _Refused(400, "this node has no tenants (--tenants-file): erase by namespaces or all")
            if not isinstance(tenant, str) or tenant not in self.tenants:
                raise _Refused(404, "no such tenant on this node")
            n = self.store.erase_owner(tenant, dry_run=dry_run)
            what = f"tenant {tenant}"
        else:
            match = EraseMatch(None) if given == ["all"] else EraseMatch(self._namespaces(body["namespaces"]))
            n = self.store.erase(match, dry_run=dry_run)
            what = "all" if match.namespaces is None else ",".join(sorted(x.hex() for x in match.namespaces))
        if not dry_run:
            self.count("erased_chunks", n)
        return (
            {"erased" if not dry_run else "would_erase": n, "dry_run": dry_run, "tier": "node"},
            f"erase {what}{' (dry run)' if dry_run else ''}: {n} chunks",
        )

    @staticmethod
    def _namespaces(names: Any) -> frozenset[bytes]:
        if not isinstance(names, list) or not names or len(names) > MAX_ERASE_NAMESPACES:
            raise _Refused(400, f'"namespaces" must be a list of 1 to {MAX_ERASE_NAMESPACES} namespace ids')
        ids = set()
        for text in names:
            ns = _namespace(text)
            if ns is None:
                raise _Refused(400, f"not a namespace id ({2 * HASH_BYTES} lowercase hex digits): {str(text)[:80]!r}")
            ids.add(ns)
        return frozenset(ids)

    def lookup(self, query: str) -> dict[str, Any]:
        try:
            q = parse_qs(query, strict_parsing=True, max_num_fields=4)
        except ValueError:
            raise _Refused(400, "bad query string") from None
        if not set(q) <= {"keys", "tenant"} or len(q.get("keys", [])) != 1 or len(q.get("tenant", [])) > 1:
            raise _Refused(400, "expected ?keys=K1,K2,... and at most one &tenant=NAME")
        keys = _keys(q["keys"][0].split(","))
        tenant = q["tenant"][0] if "tenant" in q else None
        target, where = self._target(tenant)
        stored = [where(k) for k in keys]
        held = [bool(target.contains([k])) for k in stored]
        return {"keys": len(keys), "held": held, "prefix_held": int(target.contains(stored)), "tenant": tenant}

    def retain(self, body: Any) -> tuple[dict[str, Any], str]:
        """``{"keys": [...], "seconds": S, "priority": P, "tenant": T}``: keep those
        chunks through eviction for S seconds (a key not held yet: when it arrives)."""
        if not isinstance(body, dict) or not {"keys", "seconds"} <= set(body) <= {"keys", "seconds", "priority", "tenant"}:
            raise _Refused(400, 'expected {"keys": ["v1-<ns>-<hash>", ...], "seconds": S}, optional "priority", "tenant"')
        seconds, priority = body["seconds"], body.get("priority", 0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_RETAIN_S:
            raise _Refused(400, f'"seconds" must be a number above 0 and at most {MAX_RETAIN_S:.0f} (30 days)')
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
            raise _Refused(400, f'"priority" must be an integer from 0 to {MAX_PRIORITY}')
        tenant = self._tenant_field(body)
        keys = _keys(body["keys"])
        target, where = self._target(tenant)
        n = target.retain([where(k) for k in keys], float(seconds), priority)
        reply = {"keys": len(keys), "retained": n, "pending": len(keys) - n, "seconds": seconds, "tenant": tenant}
        return reply, f"retain {len(keys)} keys of {tenant or SHARED} for {seconds} s: {n} held"

    def release(self, body: Any) -> tuple[dict[str, Any], str]:
        """``{"keys": [...], "tenant": T}``: end those chunks' retention."""
        if not isinstance(body, dict) or not {"keys"} <= set(body) <= {"keys", "tenant"}:
            raise _Refused(400, 'expected {"keys": ["v1-<ns>-<hash>", ...]}, optional "tenant"')
        tenant = self._tenant_field(body)
        keys = _keys(body["keys"])
        target, where = self._target(tenant)
        n = target.release([where(k) for k in keys])
        return {"keys": len(keys), "released": n, "tenant": tenant}, f"release {len(keys)} keys of {tenant or SHARED}: {n}"

    @staticmethod
    def _tenant_field(body: dict[str, Any]) -> str | None:
        tenant = body.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise _Refused(400, '"tenant" must be a name')
        return tenant

    def _target(self, tenant: str | None) -> tuple[Any, Callable[[ChunkKey], ChunkKey]]:
        """Where ``tenant``'s chunks live (its arena, or the store) and how a client key
        maps to the stored one there (None: the shared secret's principal)."""
        if tenant is not None and tenant not in self.tenants:
            raise _Refused(404, "no such tenant on this node")
        if hasattr(self.store, "arena_for"):
            arena = self.store.arena_for(tenant)
            if arena is None:
                raise _Refused(404, "this node keeps no chunks for the shared secret (tenants only)")
            return arena, _same
        if self.tenants:
            return self.store, lambda k: tenant_key(tenant, k)
        return self.store, _same


class Exposition(str):
    """An answer in Prometheus' text format rather than JSON."""


def _looked_up(reply: dict[str, Any]) -> tuple[dict[str, Any], str]:
    return reply, f"{reply['keys']} keys, {sum(reply['held'])} held"


ENDPOINTS: dict[tuple[str, str], Callable[[AdminServer, Any, str], tuple[Any, str]]] = {
    ("GET", "/status"): lambda admin, body, query: (admin.status(), "ok"),
    ("GET", "/lookup"): lambda admin, body, query: _looked_up(admin.lookup(query)),
    ("POST", "/erase"): lambda admin, body, query: admin.erase(body),
    ("POST", "/retain"): lambda admin, body, query: admin.retain(body),
    ("POST", "/release"): lambda admin, body, query: admin.release(body),
    ("GET", "/openapi.json"): lambda admin, body, query: (SPEC, "ok"),
    ("GET", "/metrics"): lambda admin, body, query: (Exposition(node_metrics.render(admin.status())), "ok"),
}
"""Every (method, path) the API answers: the handler of a request's body and query,
returning the JSON answer and the outcome logged."""


def _same(key: ChunkKey) -> ChunkKey:
    return key


def _keys(texts: Any) -> list[ChunkKey]:
    """Chunk keys from the client (a list of ``v1-<ns>-<hash>`` strings), within the limits."""
    if not isinstance(texts, list) or not texts or len(texts) > MAX_REQUEST_KEYS:
        raise _Refused(400, f"give 1 to {MAX_REQUEST_KEYS} chunk keys")
    try:
        return [ChunkKey.parse(t) for t in texts]
    except (ValueError, TypeError, AttributeError):
        raise _Refused(400, "keys must be chunk keys, v1-<namespace>-<hash>") from None


def _namespace(text: object) -> bytes | None:
    return namespace_of(text) if isinstance(text, str) else None


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS

    def __init__(self, listen: tuple[str, int], admin: AdminServer) -> None:
        self.admin = admin
        self.address_family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        super().__init__(listen, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks DNS for the host's name; nothing here needs it.
        TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.admin.slots.acquire(blocking=False):
            self.admin.count("refused_busy")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.admin.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.admin.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        self.admin.audit(f"{client_address[0]}: connection dropped: {type(err).__name__}: {err}")


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "lmcache-node-admin"
    sys_version = ""
    error_content_type = "application/json"
    error_message_format = '{"error": "%(message)s", "status": %(code)d}\n'

    def setup(self) -> None:
        admin = self.server.admin
        self._raw: socket.socket = self.request
        self._cut_off = False
        self._timer = threading.Timer(admin.timeout, self._cut)
        self._timer.daemon = True
        self._timer.start()
        self._raw.settimeout(admin.timeout)
        try:
            if admin.tls is not None:  # the handshake runs here, under the same deadline
                self.request = admin.tls.wrap_socket(self._raw, server_side=True)
            super().setup()
        except BaseException:
            self._timer.cancel()  # finish() does not run when setup() fails
            raise

    def _cut(self) -> None:
        """The request did not arrive in time: drop the connection whatever it is doing."""
        self._cut_off = True
        self.server.admin.count("timeouts")
        try:
            self._raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self) -> None:
        self._timer.cancel()
        try:
            super().finish()
            if self.server.admin.tls is None and not self._cut_off:
                self._linger()
        except OSError:
            pass

    def _linger(self) -> None:
        """Half-close, then read what the client still sends (a body refused unread),
        at most :data:`LINGER_BYTES` for :data:`LINGER_S`: closing with unread bytes
        would reset the connection, and the client could lose the answer with it."""
        self._raw.shutdown(socket.SHUT_WR)
        self._raw.settimeout(LINGER_S)
        end, left = time.monotonic() + LINGER_S, LINGER_BYTES
        while left > 0 and time.monotonic() < end:
            data = self._raw.recv(min(left, 65536))
            if not data:
                return
            left -= len(data)

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # each answer is logged by _answer (or log_message, for http.server's own)

    def log_message(self, format: str, *args: Any) -> None:
        self.server.admin.audit(f"{self.client_address[0]}: {(format % args)[:300]!r}")

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    # -- one request ----------------------------------------------------------------
    def _dispatch(self) -> None:
        admin = self.server.admin
        admin.count("requests")
        what = f"{self.command} {self.path[:200]!r}"
        if self._cut_off:
            return
        wait = admin.limit.wait(self.client_address[0])
        if wait > 0:
            admin.count("rate_limited")
            self._timer.cancel()
            self._answer(
                429,
                {"error": "too many requests"},
                what,
                f"refused: over {admin.limit.rate:g} requests/s",
                retry_after=max(1, math.ceil(wait)),
            )
            return
        if not admin.authorized(self.headers.get_all("Authorization") or []):
            admin.count("unauthorized")
            self._timer.cancel()
            self._answer(401, {"error": "unauthorized"}, what, "refused: no or wrong bearer token")
            return
        try:
            body = self._body()
            self._timer.cancel()
            if self._cut_off:
                return
            url = urlsplit(self.path)
            endpoint = ENDPOINTS.get((self.command, url.path))
            if endpoint is None:
                if any(path == url.path for _, path in ENDPOINTS):
                    raise _Refused(405, "method not allowed")
                raise _Refused(404, f"no such endpoint ({', '.join(f'{m} {p}' for m, p in ENDPOINTS)})")
            reply, done = endpoint(admin, body, url.query)
            self._answer(200, reply, what, done)
        except _Refused as r:
            self._timer.cancel()
            self._answer(r.code, {"error": str(r)}, what, f"refused: {r}")
        except Exception as err:  # a bug costs this request, not the node
            self._answer(500, {"error": "internal error"}, what, f"FAILED: {type(err).__name__}: {err}")

    def _body(self) -> Any:
        """The JSON body (None when empty), read within the limits."""
        if "Transfer-Encoding" in self.headers:
            raise _Refused(411, "send a Content-Length, not a chunked body")
        values = self.headers.get_all("Content-Length") or []
        if len(values) > 1:
            raise _Refused(400, "more than one Content-Length")
        text = values[0].strip() if values else "0"
        if not text.isdigit():
            raise _Refused(400, "bad Content-Length")
        length = int(text)
        if length > MAX_BODY:
            raise _Refused(413, f"body larger than {MAX_BODY} bytes")
        if length == 0:
            return None
        data = self.rfile.read(length)
        if len(data) != length:
            raise _Refused(400, "body shorter than its Content-Length")
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            raise _Refused(400, "body is not JSON") from None

    def _answer(self, code: int, obj: Any, what: str, outcome: str, retry_after: int | None = None) -> None:
        self.server.admin.audit(f"{self.client_address[0]}: {what} -> {code} {outcome}")
        text = isinstance(obj, Exposition)
        data = obj.encode() if text else (json.dumps(obj, indent=1) + "\n").encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", node_metrics.CONTENT_TYPE if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            if code == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="lmcache-node"')
            if retry_after is not None:
                self.send_header("Retry-After", str(retry_after))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass
