"""The mooncake tier's start-up probe of an http metadata server, against real
loopback sockets (no Mooncake needed): a server that answers anything is up; one
whose port accepts but that never answers (a stopped process: the kernel still
completes the handshake) is reported within the probe's time, because the native
setup would then wait 30 s per try holding the GIL."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lmcache_backend_mooncake.client import answers_http


@contextmanager
def server(reply: bytes | None) -> Iterator[str]:
    """A listening socket on loopback; with ``reply`` each connection gets those
    bytes and is closed, without it nothing is ever accepted."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    stop = threading.Event()

    def serve() -> None:
        s.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = s.accept()
            except OSError:
                continue
            with conn:
                conn.recv(4096)
                conn.sendall(reply or b"")

    t = threading.Thread(target=serve, daemon=True)
    if reply is not None:
        t.start()
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}/metadata?key=probe"
    finally:
        stop.set()
        if reply is not None:
            t.join(5)
        s.close()


def test_http_answers_of_any_status_count_as_up() -> None:
    for reply in (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"):
        with server(reply) as url:
            assert answers_http(url, 2.0) is None


def test_a_reply_that_is_not_http_still_counts_as_up() -> None:
    """Not an exception out of the probe (an http.client error is not an OSError):
    a process that writes anything, or closes the connection, is running."""
    for reply in (b"garbage\r\n\r\n", b""):
        with server(reply) as url:
            assert answers_http(url, 2.0) is None


def test_a_port_that_accepts_but_never_answers_is_reported_within_the_timeout() -> None:
    with server(None) as url:
        t0 = time.monotonic()
        why = answers_http(url, 0.5)
        took = time.monotonic() - t0
    assert why is not None and "did not answer a GET within 0.5 s" in why and took < 2.0, (why, took)


def test_a_closed_port_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = answers_http(f"http://127.0.0.1:{port}/metadata", 0.5)
    assert why is not None and "did not answer" in why
