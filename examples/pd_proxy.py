#!/usr/bin/env python3
"""Prefill/decode split through lmcache-core: a small OpenAI-compatible proxy.

Each completion request goes first to the prefill engine (``kv_role: kv_producer``)
with ``max_tokens: 1``: it computes the prompt's KV, which the connector saves into
the shared tier; then the unchanged request goes to the decode engine
(``kv_role: kv_consumer``), whose connector loads that KV instead of computing it,
and its answer (streamed or not) is returned to the client.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

If the prefill engine fails or times out, the request still goes to the decode
engine, which then computes the prompt itself (slower, same output). Standard
library only; loopback or a trusted network (it adds no authentication of its own:
run it where the engines' own ``--api-key`` would be, and it forwards
``Authorization``).

It serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (prefill, then
decode) and ``GET /v1/models`` and ``GET /health`` (the decode engine answers);
any other path is 404, another method on these paths 405, an absolute URL as the
request target 400. The engines always get the configured engine's host as
``Host`` and one of these four paths, whatever the client sent. Every limit is
bounded and answered with an OpenAI-style JSON error
(``{"error": {"message", "type", "code"}}``):

- ``--client-timeout`` (30 s): the whole request, head and body, must arrive within
  it (one deadline, not per read: trickling does not extend it), else 408; a write
  to a client that stops reading waits at most this long.
- ``--header-timeout`` (10 s): the request line and headers must arrive within it,
  else 408.
- ``--connect-timeout`` (10 s) and ``--timeout`` (600 s): each engine call's connect
  and total time, the relayed answer included (504; an unreachable engine is 502).
- ``--max-connections`` (256): connections handled at once, one thread each. When
  they are all taken, a new connection takes the slot of the one that has waited
  longest without sending its whole request (that one gets 503 and is closed), so
  stalled sockets cannot lock clients out; when every connection is past its request
  (an engine call), a new one gets an immediate 503 from the accepting thread, no
  thread.
- ``--max-per-client`` (64): connections from one client address at once; above it
  an immediate 503 (a deployment behind one router or load balancer: raise it to
  ``--max-connections``).
- ``--max-body`` (4 MiB): a larger ``Content-Length`` is answered 413 before any of
  the body is read; a POST without ``Content-Length`` (or chunked) is 411; the
  request head is limited to 64 KiB (431).
- ``--max-pending-bytes`` (64 MiB): request bodies held at once (from being read until
  sent to the decode engine, the prefill call included); a body that does not fit is
  503, unread.
- bodies that are not a JSON object, including nesting too deep to parse, are 400;
  so is a head with a folded header line (one starting with a space or a tab,
  obsolete line folding) or a line that is not ``name: value``, before anything of
  it is forwarded.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import io
import json
import logging
import re
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("pd_proxy")

POST_ROUTES = ("/v1/completions", "/v1/chat/completions")
GET_ROUTES = ("/v1/models", "/health")  # read-only, answered by the decode engine
FORWARDED = ("Authorization", "Content-Type")
RELAYED_BACK = ("Content-Type", "Content-Length", "Cache-Control")
MAX_HEAD = 64 << 10  # request line and headers together
LINGER_BYTES = 64 << 10  # after an early answer: discarded at most, so the close is a FIN
LINGER_S = 1.0
CHUNK = 64 << 10
_DIGITS = re.compile(r"[0-9]{1,18}")
_FIELD_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    411: "LengthRequiredError",
    413: "PayloadTooLargeError",
    431: "HeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
    505: "HTTPVersionNotSupportedError",
}


def error_body(status: int, message: str) -> bytes:
    """An OpenAI-style error, the shape vLLM's own errors have."""
    return json.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "code": status}}).encode()


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill engine: the same prompt and sampling, one token,
    not streamed."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("n", None)
    return out


@dataclass(frozen=True)
class Settings:
    prefill: str
    decode: str
    timeout: float = 600.0
    connect_timeout: float = 10.0
    client_timeout: float = 30.0
    header_timeout: float = 10.0
    max_body: int = 4 << 20
    max_connections: int = 256
    max_per_client: int = 64
    max_pending_bytes: int = 64 << 20


class _RequestTimeout(Exception):
    """The client did not deliver its whole request before its deadline."""


class _HeadTimeout(_RequestTimeout):
    """The client did not deliver the request line and headers within --header-timeout."""


class _Shed(Exception):
    """The connection's slot went to a newer one while this one was still sending its
    request (the proxy was full)."""


@dataclass(eq=False)
class _Conn:
    """One accepted connection, as the server counts it."""

    sock: socket.socket
    client: str
    since: float = field(default_factory=time.monotonic)
    reading: bool = True  # its whole request has not arrived yet: it may be shed
    shed: bool = False


class _HeadTooLarge(Exception):
    """The request line and headers did not end within MAX_HEAD bytes."""


class _DeadlineReader(io.RawIOBase):
    """A socket's reads against one deadline for a whole exchange. Each recv waits at
    most the time left, so a peer that trickles a byte at a time cannot stretch it (a
    per-recv timeout restarts with every byte). While ``head_left`` is not None it also
    bounds the bytes read, so a head cannot grow to 100 lines of 64 KiB."""

    def __init__(
        self,
        sock: socket.socket,
        deadline: float,
        expired: type[Exception],
        head_left: int | None = None,
        conn: _Conn | None = None,
    ):
        super().__init__()
        self.sock = sock
        self._raw = sock.makefile("rb", buffering=0)  # keeps the descriptor open until closed, as makefile does
        self.deadline = deadline
        self.expired = expired
        self.head_left = head_left
        self.conn = conn  # shed: the accepting thread shut our reading side down

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.expired("deadline passed")
        view = memoryview(buf).cast("B")
        if self.head_left is not None:
            if self.head_left <= 0:
                raise _HeadTooLarge
            view = view[: self.head_left]
        self.sock.settimeout(left)
        try:
            n = self._raw.readinto(view) or 0
        except TimeoutError:
            raise self.expired("deadline passed") from None
        if self.conn is not None and self.conn.shed:
            raise _Shed
        if self.head_left is not None:
            self.head_left -= n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """An engine connection's socket as http.client sees it: sends and the response's
    reads all count against the call's one total deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self.deadline = deadline

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self.deadline, TimeoutError))

    def sendall(self, data: Any) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self._sock.settimeout(left)  # sendall's timeout bounds the whole call
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _HeadLines:
    """The request's file as http.server reads the headers from it (``readline``
    only), keeping the lines so that they can be checked before anything is used."""

    def __init__(self, fp: Any):
        self.fp = fp
        self.lines: list[bytes] = []

    def readline(self, limit: int = -1) -> bytes:
        line = self.fp.readline(limit)
        self.lines.append(line)
        return bytes(line)


def bad_header_line(lines: list[bytes]) -> str | None:
    """Why a request's header lines are refused, or None: a line folded onto the one
    before (starting with a space or a tab: obsolete line folding, which parsers join
    or split differently, so forwarding it lets a client smuggle a header past one of
    them), or a line that is not ``name: value``."""
    for line in lines:
        if line in (b"\r\n", b"\n", b""):
            break
        if line[:1] in (b" ", b"\t"):
            return "a folded header line (starting with a space or a tab) is not accepted"
        name, colon, _ = line.partition(b":")
        if not colon or not _FIELD_NAME.fullmatch(name):
            return "a header line must be name: value, with no space before the colon"
    return None


class UpstreamError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Engine:
    """One engine's base URL, checked once at start-up."""

    def __init__(self, role: str, url: str):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        u.port  # noqa: B018 - raises ValueError on a malformed port
        self.role = role
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port
        self.prefix = u.path.rstrip("/")

    def call(
        self, method: str, route: str, body: bytes | None, headers: dict[str, str], settings: Settings
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send one request; the response's status and headers have arrived when this
        returns, and reading its body stays bounded by the same total deadline. The
        target is always the engine's prefix plus one of the fixed routes, and
        http.client sets ``Host`` from the engine's address."""
        deadline = time.monotonic() + settings.timeout
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=min(settings.connect_timeout, settings.timeout))
        try:
            try:
                conn.connect()
            except TimeoutError as err:
                raise UpstreamError(504, f"{self.role} engine: no connection within {settings.connect_timeout:g} s") from err
            except OSError as err:
                raise UpstreamError(502, f"{self.role} engine unreachable: {err}") from err
            conn.sock = _DeadlineSocket(conn.sock, deadline)
            try:
                conn.request(method, self.prefix + route, body, headers)
                return conn, conn.getresponse()
            except TimeoutError as err:
                raise UpstreamError(504, f"{self.role} engine did not answer within {settings.timeout:g} s") from err
            except (OSError, http.client.HTTPException) as err:
                raise UpstreamError(502, f"{self.role} engine failed: {err}") from err
            except ValueError as err:  # a forwarded header http.client will not send
                raise UpstreamError(400, f"a forwarded header is not valid: {err}") from err
        except BaseException:
            conn.close()
            raise


class Proxy(BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0 answers, then close): nothing idles
    between requests, and every step is bounded by a deadline or a byte limit."""

    server: ProxyServer
    server_version = "lmcache-pd-proxy/1"
    default_request_version = "HTTP/1.0"  # errors always carry a status line

    def setup(self) -> None:
        super().setup()
        self.settings = self.server.settings
        self.requestline = ""
        self.request_version = self.default_request_version
        self._replied = False
        self.rfile.close()
        self._conn = self.server.conn_of(self.connection)
        start = time.monotonic()
        self._deadline = start + self.settings.client_timeout
        head_s = min(self.settings.header_timeout, self.settings.client_timeout)
        head_expired = _HeadTimeout if self.settings.header_timeout < self.settings.client_timeout else _RequestTimeout
        self._reader = _DeadlineReader(self.connection, start + head_s, head_expired, head_left=MAX_HEAD, conn=self._conn)
        self.rfile = io.BufferedReader(self._reader)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.info("%s " + fmt, self.address_string(), *args)

    def handle(self) -> None:
        self.close_connection = True
        try:
            self._serve()
        except _Shed:
            self._fail(
                503,
                f"the proxy is handling --max-connections ({self.settings.max_connections}) connections and this one "
                "had not sent its whole request: retry",
                {"Retry-After": "1"},
            )
        except _HeadTimeout:
            self._fail(
                408,
                f"the request line and headers were not received within {self.settings.header_timeout:g} s (--header-timeout)",
            )
        except _RequestTimeout:
            self._fail(408, f"the request was not received within {self.settings.client_timeout:g} s (--client-timeout)")
        except _HeadTooLarge:
            self._fail(431, f"the request line and headers exceed {MAX_HEAD >> 10} KiB")
        except OSError as err:  # the client went away or stopped reading
            log.info("%s connection dropped: %s", self.address_string(), err)
        except Exception:
            log.exception("unexpected error")
            self._fail(500, "internal proxy error")

    def _serve(self) -> None:
        self.raw_requestline = self.rfile.readline(MAX_HEAD + 1)
        if not self.raw_requestline:
            if self._conn is not None and self._conn.shed:
                raise _Shed
            return  # connected and closed without a request
        head = _HeadLines(self.rfile)
        self.rfile = head  # type: ignore[assignment]  # parse_request reads the header lines through it
        try:
            parsed = self.parse_request()
        finally:
            self.rfile = head.fp
        if self._conn is not None and self._conn.shed:
            raise _Shed  # the head may have ended at the shutdown
        if not parsed:
            return  # answered through send_error
        why = bad_header_line(head.lines)
        if why is not None:
            self._fail(400, why)
            return
        self._reader.head_left = None
        self._reader.deadline = self._deadline  # the body: what is left of --client-timeout
        self._reader.expired = _RequestTimeout
        route = self._route()
        if route is None:
            return
        if self.command == "GET":
            self._received()
            answer = self._call(self.server.decode, "GET", route, None)
        else:
            answer = self._post(route)
        if answer is not None:
            self._relay(*answer)

    def _route(self) -> str | None:
        """The fixed route the request names, or None once it has been answered."""
        if not self.path.startswith("/"):
            self._fail(400, "the request target must be a path, not an absolute URL")
            return None
        path = self.path.split("?", 1)[0]
        allowed = "POST" if path in POST_ROUTES else "GET" if path in GET_ROUTES else None
        if allowed is None:
            served = ", ".join([f"POST {r}" for r in POST_ROUTES] + [f"GET {r}" for r in GET_ROUTES])
            self._fail(404, f"no route {path[:200]!r}: this proxy serves {served}")
            return None
        if self.command != allowed:
            self._fail(405, f"{path} takes {allowed}, not {str(self.command)[:20]!r}", {"Allow": allowed})
            return None
        return path

    def _content_length(self) -> int | None:
        """The body's announced length, or None once the request has been refused:
        nothing of the body is read before it is known to fit."""
        if self.headers.get("Transfer-Encoding") is not None:
            self._fail(411, "chunked request bodies are not accepted: send Content-Length")
            return None
        values = self.headers.get_all("Content-Length") or []
        if not values:
            self._fail(411, "Content-Length is required")
            return None
        text = values[0].strip()
        if len(values) > 1 or not text.isascii() or not text.isdigit():
            self._fail(400, "one decimal Content-Length is required")
            return None
        if not _DIGITS.fullmatch(text) or int(text) > self.settings.max_body:
            self._fail(413, f"a JSON body of at most {self.settings.max_body} bytes is accepted (--max-body)")
            return None
        return int(text)

    def _post(self, route: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse] | None:
        n = self._content_length()
        if n is None:
            return None
        if not self.server.reserve(n):
            self._fail(
                503,
                f"request bodies waiting here already hold {self.settings.max_pending_bytes} bytes (--max-pending-bytes)",
                {"Retry-After": "1"},
            )
            return None
        try:
            return self._forward(route, n)
        finally:
            self.server.release(n)  # the body is no longer held once this returns

    def _received(self) -> None:
        """The whole request is here: from now on this connection is not shed."""
        if not self.server.received(self._conn):
            raise _Shed

    def _forward(self, route: str, n: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse] | None:
        raw = self.rfile.read(n)
        if len(raw) < n:
            self._fail(400, f"the body ended after {len(raw)} of {n} bytes")
            return None
        self._received()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            to_prefill = json.dumps(prefill_body(body)).encode()
        except RecursionError:
            self._fail(400, "bad JSON body: nested too deeply")
            return None
        except ValueError as err:
            self._fail(400, f"bad JSON body: {err}")
            return None
        del body
        self._prefill(route, to_prefill)
        del to_prefill
        return self._call(self.server.decode, "POST", route, raw)

    def _headers(self) -> dict[str, str]:
        return {h: self.headers[h] for h in FORWARDED if self.headers.get(h)}

    def _prefill(self, route: str, data: bytes) -> None:
        """Ask the prefill engine for one token; its answer is read and dropped. A
        failure only costs the decode engine the prompt's computation."""
        try:
            conn, resp = self.server.prefill.call("POST", route, data, self._headers(), self.settings)
        except UpstreamError as err:
            log.warning("%s: the decode engine computes the prompt", err.message)
            return
        try:
            while resp.read1(CHUNK):
                pass
            if resp.status != 200:
                log.warning("prefill engine answered %d: the decode engine computes the prompt", resp.status)
        except TimeoutError:
            log.warning("prefill engine took over %g s: the decode engine computes the prompt", self.settings.timeout)
        except (OSError, http.client.HTTPException) as err:
            log.warning("prefill engine failed (%s): the decode engine computes the prompt", err)
        finally:
            resp.close()  # it may hold the socket after http.client let go of it
            conn.close()

    def _call(
        self, engine: Engine, method: str, route: str, body: bytes | None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse] | None:
        try:
            return engine.call(method, route, body, self._headers(), self.settings)
        except UpstreamError as err:
            log.warning("%s", err.message)
            self._fail(err.status, err.message)
            return None

    def _relay(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        """The decode engine's answer, passed through as it comes (streams included),
        until it ends or the call's deadline cuts it."""
        try:
            self.connection.settimeout(self.settings.client_timeout)
            self._replied = True
            self.send_response(resp.status)
            for h in RELAYED_BACK:
                if resp.getheader(h):
                    self.send_header(h, resp.getheader(h, ""))
            self.send_header("Connection", "close")
            self.end_headers()
            while True:
                try:
                    chunk = resp.read1(CHUNK)
                except TimeoutError:
                    log.warning("decode engine's answer cut at --timeout (%g s)", self.settings.timeout)
                    break
                except (OSError, http.client.HTTPException) as err:
                    log.warning("decode engine's answer broke off: %s", err)
                    break
                if not chunk:
                    break
                self.wfile.write(chunk)
        finally:
            resp.close()
            conn.close()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line or headers) as JSON."""
        self._fail(int(code), message or self.responses.get(code, ("error",))[0])

    def _fail(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        """Answer with a JSON error unless an answer has started, then close."""
        if self._replied:
            return
        self._replied = True
        data = error_body(status, message)
        try:
            self.connection.settimeout(self.settings.client_timeout)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self._linger()
        except OSError:
            pass

    def _linger(self) -> None:
        """Close after an early answer without resetting the connection: a client that
        is still sending its (refused) body would otherwise get an RST that can destroy
        our answer before it reads it. Bounded: at most LINGER_BYTES discarded, LINGER_S
        waited; a client sending more gets the reset."""
        self.connection.shutdown(socket.SHUT_WR)
        end = time.monotonic() + LINGER_S
        left = LINGER_BYTES
        while left > 0:
            wait = end - time.monotonic()
            if wait <= 0:
                return
            self.connection.settimeout(wait)
            data = self.connection.recv(min(left, CHUNK))
            if not data:
                return
            left -= len(data)


def _busy_answer(message: str) -> bytes:
    body = error_body(503, message)
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class ProxyServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` counted at once and
    ``max_per_client`` from one address. The accepting thread refuses a connection
    over either bound itself (503, no thread), except that when all slots are taken it
    first sheds the connection that has waited longest without sending its whole
    request: its reading side is shut down, which wakes its thread at once to answer
    503 and end. So stalled or trickling clients hold slots only until someone needs
    them, and threads stay bounded (a shed thread ends within moments; at most
    ``max_connections`` of them are let finish at once)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], settings: Settings):
        self.settings = settings
        self.prefill = Engine("prefill", settings.prefill)
        self.decode = Engine("decode", settings.decode)
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._active = 0  # connections counted against max_connections (not shed)
        self._shedding = 0  # shed ones whose threads have not ended yet
        self._per_client: collections.Counter[str] = collections.Counter()
        self.shed_count = 0
        self._busy = _busy_answer(
            f"the proxy is handling --max-connections ({settings.max_connections}) connections: retry later"
        )
        self._client_busy = _busy_answer(
            f"this client has --max-per-client ({settings.max_per_client}) connections open here: retry later"
        )
        self._pending_lock = threading.Lock()
        self._pending = 0
        super().__init__(address, Proxy)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        client = str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""
        victim = None
        with self._lock:
            if self._per_client[client] >= self.settings.max_per_client:
                answer = self._client_busy
            elif self._active >= self.settings.max_connections and not (victim := self._shed_one()):
                answer = self._busy
            else:
                self._conns[request] = _Conn(request, client)
                self._active += 1
                self._per_client[client] += 1
                answer = b""
        if victim is not None:
            try:  # wakes its thread's read at once: it answers 503 and ends
                victim.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        if not answer:
            return True
        try:  # a fresh socket's send buffer holds the answer: one send, no waiting
            request.setblocking(False)
            request.send(answer)
            for _ in range(4):  # what already arrived, so the close is a FIN, not an RST
                if not request.recv(CHUNK):
                    break
        except OSError:
            pass
        return False  # socketserver closes it

    def _shed_one(self) -> _Conn | None:
        """Under the lock: take the slot of the connection that has waited longest
        without sending its whole request, or None (none such, or too many shed
        connections still finishing)."""
        if self._shedding >= self.settings.max_connections:
            return None
        oldest = None
        for c in self._conns.values():  # at most max_connections * 2
            if c.reading and not c.shed and (oldest is None or c.since < oldest.since):
                oldest = c
        if oldest is None:
            return None
        oldest.shed = True
        self._active -= 1
        self._shedding += 1
        self._uncount(oldest.client)
        self.shed_count += 1
        return oldest

    def _uncount(self, client: str) -> None:
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]

    def conn_of(self, request: Any) -> _Conn | None:
        with self._lock:
            return self._conns.get(request)

    def received(self, conn: _Conn | None) -> bool:
        """The connection's whole request has arrived: it may no longer be shed.
        False when it was shed first."""
        if conn is None:
            return True
        with self._lock:
            if conn.shed:
                return False
            conn.reading = False
            return True

    def _forget(self, request: Any) -> None:
        with self._lock:
            conn = self._conns.pop(request, None)
            if conn is None:
                return
            if conn.shed:
                self._shedding -= 1
            else:
                self._active -= 1
                self._uncount(conn.client)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def reserve(self, n: int) -> bool:
        """Count a body of ``n`` bytes against --max-pending-bytes, if it fits."""
        with self._pending_lock:
            if self._pending + n > self.settings.max_pending_bytes:
                return False
            self._pending += n
            return True

    def release(self, n: int) -> None:
        with self._pending_lock:
            self._pending -= n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer engine")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    d = Settings("", "")
    ap.add_argument(
        "--timeout", type=float, default=d.timeout, help="seconds for each engine call, its answer (streamed or not) included"
    )
    ap.add_argument("--connect-timeout", type=float, default=d.connect_timeout, help="seconds to connect to an engine")
    ap.add_argument(
        "--client-timeout",
        type=float,
        default=d.client_timeout,
        help="seconds a client has to send its whole request; also the longest one write to a client may block",
    )
    ap.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        help="seconds a client has to send its request line and headers",
    )
    ap.add_argument("--max-body", type=int, default=d.max_body, help="largest request body accepted (bytes)")
    ap.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="connections handled at once (when full, one still sending its request is shed for a new one)",
    )
    ap.add_argument(
        "--max-per-client",
        type=int,
        default=d.max_per_client,
        help="connections from one client address at once (behind one router: set it to --max-connections)",
    )
    ap.add_argument(
        "--max-pending-bytes", type=int, default=d.max_pending_bytes, help="request bodies held in memory at once (bytes)"
    )
    args = ap.parse_args(argv)
    for name in (
        "timeout",
        "connect_timeout",
        "client_timeout",
        "header_timeout",
        "max_body",
        "max_connections",
        "max_per_client",
        "max_pending_bytes",
    ):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_body > args.max_pending_bytes:
        ap.error("--max-body must not exceed --max-pending-bytes")
    settings = Settings(
        prefill=args.prefill,
        decode=args.decode,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
        client_timeout=args.client_timeout,
        header_timeout=args.header_timeout,
        max_body=args.max_body,
        max_connections=args.max_connections,
        max_per_client=args.max_per_client,
        max_pending_bytes=args.max_pending_bytes,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pd_proxy %(levelname)s %(message)s")
    try:
        srv = ProxyServer((args.host, args.port), settings)  # fails early on a malformed URL
    except ValueError as err:
        ap.error(str(err))
    print(f"pd_proxy listening on http://{args.host}:{srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
