"""One framed, deadline-bounded TCP connection (used by both client and server).

Every read and write runs against an absolute deadline (``time.monotonic()``), so a
peer that stops answering, or trickles one byte at a time, costs at most the time
left on the request, never a hang.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Iterator, Sequence

from .protocol import HEADER_SIZE, Buffer, Header, PeerError, decode_header, message_parts

MAX_FDS = 4
"""Most file descriptors read with one message (more are closed at once)."""


REUSE_LIMIT = 64 << 20
"""Largest reply read into the per-connection buffer; bigger ones get their own."""


class PeerTimeout(PeerError):
    """The peer did not answer within the deadline."""


class PeerClosed(PeerError):
    """The peer closed the connection (or it broke) mid-message."""


class Connection:
    """A socket plus framing. Not thread-safe: one request at a time."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.closed = False
        self.local = sock.family == socket.AF_UNIX
        """A Unix-socket connection: same host, may pass file descriptors."""
        self.server_id = b""
        """The server instance this client connection authenticated to."""
        self._rbuf = bytearray()
        if not self.local:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeout(f"{self.peer}: timed out")
        return left

    @contextlib.contextmanager
    def _socket_errors(self, doing: str) -> Iterator[None]:
        """Turn what the socket raises while ``doing`` (reading, sending) into the peer
        errors callers handle: a timeout, or a closed/broken connection."""
        try:
            yield
        except socket.timeout:
            raise PeerTimeout(f"{self.peer}: timed out {doing}") from None
        except PeerError:
            raise
        except OSError as err:
            raise PeerClosed(f"{self.peer}: {doing} failed: {err}") from None

    def send(self, mtype: int, request_id: int, body_parts: Sequence[Buffer], deadline: float) -> None:
        """Send one message; large parts are written without being joined."""
        parts = message_parts(mtype, request_id, body_parts)
        small = bytearray()
        with self._socket_errors("sending"):
            for p in parts:
                mv = memoryview(p).cast("B")
                if mv.nbytes <= 64 * 1024:
                    small += mv
                    continue
                if small:
                    self.sock.settimeout(self._remaining(deadline))
                    self.sock.sendall(small)
                    small = bytearray()
                self.sock.settimeout(self._remaining(deadline))
                self.sock.sendall(mv)
            if small:
                self.sock.settimeout(self._remaining(deadline))
                self.sock.sendall(small)

    def send_fd(self, mtype: int, request_id: int, body_parts: Sequence[Buffer], fd: int, deadline: float) -> None:
        """Send one small message with ``fd`` attached (SCM_RIGHTS; Unix sockets only)."""
        data = b"".join(bytes(p) for p in message_parts(mtype, request_id, body_parts))
        with self._socket_errors("sending"):
            self.sock.settimeout(self._remaining(deadline))
            n = socket.send_fds(self.sock, [data], [fd])
            if n < len(data):
                self.sock.settimeout(self._remaining(deadline))
                self.sock.sendall(data[n:])

    def recv_fds(self, deadline: float, max_body: int) -> tuple[Header, memoryview, list[int]]:
        """Read one message and the file descriptors that came with its header (the
        caller owns them; all are closed here if the message is bad)."""
        hbuf = bytearray(HEADER_SIZE)
        got = 0
        fds: list[int] = []
        try:
            with self._socket_errors("reading"):
                while got < HEADER_SIZE:
                    self.sock.settimeout(self._remaining(deadline))
                    data, new, _, _ = socket.recv_fds(self.sock, HEADER_SIZE - got, MAX_FDS)
                    fds.extend(new)
                    if not data:
                        raise PeerClosed(f"{self.peer}: connection closed after {got} of {HEADER_SIZE} bytes")
                    hbuf[got : got + len(data)] = data
                    got += len(data)
            header = decode_header(hbuf, max_body)
            return header, self.recv_body(header, deadline), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _recv_exact(self, buf: memoryview, deadline: float) -> None:
        got = 0
        n = buf.nbytes
        with self._socket_errors("reading"):
            while got < n:
                self.sock.settimeout(self._remaining(deadline))
                r = self.sock.recv_into(buf[got:], n - got)
                if r == 0:
                    raise PeerClosed(f"{self.peer}: connection closed after {got} of {n} bytes")
                got += r

    def recv(
        self, header_deadline: float, max_body: int, body_timeout: float | None = None, *, reuse: bool = False
    ) -> tuple[Header, memoryview]:
        """Read one message. The header must arrive by ``header_deadline``; the body by
        then too, or, with ``body_timeout``, within that many seconds of the header.

        With ``reuse`` the body is a view into this connection's receive buffer, valid
        only until the next ``recv`` (saves allocating and faulting in fresh pages for
        every large reply); otherwise it is a fresh buffer the caller owns."""
        header = self.recv_header(header_deadline, max_body)
        deadline = header_deadline if body_timeout is None else time.monotonic() + body_timeout
        return header, self.recv_body(header, deadline, reuse=reuse)

    def recv_header(self, deadline: float, max_body: int, rest_timeout: float | None = None) -> Header:
        """Read and bound one message header (nothing is allocated for the body yet,
        so the caller can decide whether it may: see the server's in-flight budget).

        The header must arrive by ``deadline``; with ``rest_timeout`` only its first
        byte must, and the rest within ``rest_timeout`` seconds of that byte. A server
        waits long for the next request of a pooled connection (``deadline``), but a
        request that has begun must not hold the connection that long: a client that
        sends half a header and then nothing would otherwise keep its slot and thread
        until the idle deadline."""
        hbuf = memoryview(bytearray(HEADER_SIZE))
        if rest_timeout is None:
            self._recv_exact(hbuf, deadline)
        else:
            got = self._recv_some(hbuf, deadline)
            self._recv_exact(hbuf[got:], time.monotonic() + rest_timeout)
        return decode_header(hbuf, max_body)

    def _recv_some(self, buf: memoryview, deadline: float) -> int:
        """Read at least one byte (at most ``buf.nbytes``) by ``deadline``."""
        with self._socket_errors("waiting for a request"):
            self.sock.settimeout(self._remaining(deadline))
            r = self.sock.recv_into(buf, buf.nbytes)
        if r == 0:
            raise PeerClosed(f"{self.peer}: connection closed")
        return r

    def recv_body(self, header: Header, deadline: float, *, reuse: bool = False) -> memoryview:
        """Read the body announced by ``header`` (see :meth:`recv` for ``reuse``)."""
        if reuse and header.body_len <= REUSE_LIMIT:
            if len(self._rbuf) < header.body_len:
                self._rbuf = bytearray(header.body_len)
            body = memoryview(self._rbuf)[: header.body_len]
        else:
            body = memoryview(bytearray(header.body_len))
        if header.body_len:
            self._recv_exact(body, deadline)
        return body

    def discard(self, n: int, deadline: float) -> None:
        """Read and drop ``n`` bytes through a small scratch buffer (a body the server
        refuses but must step over to keep the connection in step)."""
        scratch = memoryview(bytearray(min(n, 64 * 1024)))
        while n > 0:
            step = min(n, scratch.nbytes)
            self._recv_exact(scratch[:step], deadline)
            n -= step

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
