"""bench/latency_proxy.py, the network the remote-tier benchmarks run through: every
byte arrives intact and in order, half a round trip late each way, a half-close passes
through, and stop() ends every connection. Real sockets on loopback."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from latency_proxy import LatencyProxy, loopback_server  # noqa: E402


def _echo_server() -> tuple[socket.socket, tuple[str, int]]:
    """Echoes what it reads; closes its side after the client's half-close."""

    def handle(c: socket.socket) -> None:
        while data := c.recv(1 << 16):
            c.sendall(data)

    return loopback_server(handle)


def _recv_all(s: socket.socket) -> bytes:
    out = bytearray()
    while data := s.recv(1 << 16):
        out += data
    return bytes(out)


@pytest.mark.parametrize("in_process", [False, True], ids=["child-process", "in-process"])
def test_bytes_arrive_intact_in_order_after_one_round_trip(in_process):
    srv, addr = _echo_server()
    payload = bytes(range(256)) * 40_000  # 10 MiB, position-dependent
    with srv, LatencyProxy(addr, rtt_ms=40, in_process=in_process) as proxy:
        with socket.create_connection(proxy.address, timeout=30) as s:
            t = time.perf_counter()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            ping = time.perf_counter() - t
            sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
            sender.start()
            echoed = _recv_all(s)  # ends only if the half-close went through both ways
            sender.join(30)
        assert proxy.connections == (1 if in_process else None)
    assert 0.040 <= ping < 0.5  # one round trip, and not several
    assert echoed == payload


@pytest.mark.parametrize("in_process", [False, True], ids=["child-process", "in-process"])
def test_without_delay_a_ping_is_fast_and_stop_ends_open_connections(in_process):
    srv, addr = _echo_server()
    proxy = LatencyProxy(addr, rtt_ms=0, in_process=in_process).start()
    with srv, socket.create_connection(proxy.address, timeout=10) as s:
        t = time.perf_counter()
        s.sendall(b"y")
        assert s.recv(1) == b"y"
        assert time.perf_counter() - t < 0.040  # negative control for the delay above
        t = time.perf_counter()
        proxy.stop()  # the connection is still open
        assert time.perf_counter() - t < 10
        assert s.recv(1) == b""  # the proxy closed it
