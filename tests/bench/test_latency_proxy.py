"""bench/lib/latency_proxy.py, the network the remote-tier benchmarks run through: every
byte arrives intact and in order, half a round trip late each way, a half-close passes
through, and stop() ends every connection; a peer that stops reading holds the sender
back (the window), and connections past the cap are closed (threads bounded). Real
sockets on loopback."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from lib.latency_proxy import LatencyProxy, loopback_server  # noqa: E402


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
        pings = []
        for _ in range(5):  # the fastest of five: one stall of a loaded machine is not the proxy's delay
            t = time.perf_counter()
            s.sendall(b"y")
            assert s.recv(1) == b"y"
            pings.append(time.perf_counter() - t)
        assert min(pings) < 0.040, pings  # negative control for the delay above
        t = time.perf_counter()
        proxy.stop()  # the connection is still open
        assert time.perf_counter() - t < 10
        assert s.recv(1) == b""  # the proxy closed it


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the proxy's /proc status")


@needs_proc
def test_a_peer_that_stops_reading_holds_the_sender_back_not_the_proxys_memory():
    """The finding: the relay read whatever one side sent, however slowly the other
    took it (396 MiB held for a peer that never read). Now a direction holds at most
    its window (4 MiB): while the server reads nothing the client gets about 12 MiB
    into the kernel's and the proxy's buffers of the 64 MiB it sends (before: all 64,
    and the proxy's RSS grew 61 MiB); once the server reads, every byte arrives, in
    order (the control: backpressure, not loss)."""
    go = threading.Event()
    got = bytearray()

    def handle(c: socket.socket) -> None:
        go.wait(30)
        while data := c.recv(1 << 20):
            got.extend(data)

    srv, addr = loopback_server(handle)
    payload = bytes(range(256)) * (256 << 10)  # 64 MiB, position-dependent
    with srv, LatencyProxy(addr, rtt_ms=2) as proxy:
        assert proxy.pid is not None
        rss0 = _status(proxy.pid, "VmRSS")
        with socket.create_connection(proxy.address, timeout=30) as s:
            sent = [0]

            def push() -> None:
                view = memoryview(payload)
                while sent[0] < len(payload):
                    sent[0] += s.send(view[sent[0] : sent[0] + (1 << 20)])
                s.shutdown(socket.SHUT_WR)

            pusher = threading.Thread(target=push, daemon=True)
            pusher.start()
            time.sleep(1.0)  # the server reads nothing meanwhile
            stalled_at, grown = sent[0], _status(proxy.pid, "VmRSS") - rss0
            go.set()
            pusher.join(30)
            deadline = time.monotonic() + 30
            while len(got) < len(payload) and time.monotonic() < deadline:
                time.sleep(0.01)
    assert stalled_at < 32 << 20, f"{stalled_at >> 20} MiB accepted for a peer that reads nothing"
    assert grown < 16 << 10, f"the proxy's RSS grew {grown >> 10} MiB"
    assert bytes(got) == payload


def test_the_window_bounds_what_is_in_flight():
    """A direction holds at most ``window`` bytes: 8 MiB through a 1 MiB window at
    20 ms RTT takes at least 8 one-way delays (80 ms); the relay's peak is the window.
    Control: a 16 MiB window carries the same 8 MiB in about one."""
    srv, addr = _bulk_server_once(8 << 20)
    with srv:
        times = {}
        for window in (1 << 20, 16 << 20):
            with LatencyProxy(addr, rtt_ms=20, in_process=True, window=window) as proxy:
                with socket.create_connection(proxy.address, timeout=30) as s:
                    t = time.perf_counter()
                    s.sendall(b"B")
                    _recv_exactly(s, 8 << 20)
                    times[window] = time.perf_counter() - t
                    assert proxy._relay is not None and proxy._relay.peak_held() <= window
    assert times[1 << 20] >= 0.080, times
    assert times[16 << 20] < times[1 << 20], times


def _bulk_server_once(size: int) -> tuple[socket.socket, tuple[str, int]]:
    """Answers each byte it reads with ``size`` bytes."""
    payload = b"x" * size

    def handle(c: socket.socket) -> None:
        while c.recv(1):
            c.sendall(payload)

    return loopback_server(handle)


def _recv_exactly(s: socket.socket, size: int) -> None:
    buf = memoryview(bytearray(size))
    got = 0
    while got < size:
        n = s.recv_into(buf[got:])
        assert n, "closed early"
        got += n


@needs_proc
def test_connections_past_the_cap_are_closed_and_threads_stay_bounded():
    """The finding: 400 idle connections made 1,602 threads. With max_connections 8,
    8 connections are relayed (echoed through, four threads each), the next 12 are
    closed at once unrelayed, the proxy runs at most 4 x 8 + 2 threads, and a slot is
    free again once a relayed connection closes (the control)."""
    srv, addr = _echo_server()
    with srv, LatencyProxy(addr, rtt_ms=0, max_connections=8) as proxy:
        assert proxy.pid is not None
        conns = [socket.create_connection(proxy.address, timeout=10) for _ in range(20)]
        try:
            relayed = []
            for c in conns:
                try:
                    c.sendall(b"e")
                    relayed.append(c.recv(1) == b"e")
                except OSError:
                    relayed.append(False)
            assert relayed == [True] * 8 + [False] * 12, relayed
            assert _status(proxy.pid, "Threads") <= 4 * 8 + 2
            conns[0].close()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the slot frees once the proxy sees the close
                with socket.create_connection(proxy.address, timeout=10) as extra:
                    extra.sendall(b"f")
                    try:
                        if extra.recv(1) == b"f":
                            break
                    except OSError:
                        pass
                time.sleep(0.05)
            else:
                raise AssertionError("no slot freed after a relayed connection closed")
        finally:
            for c in conns:
                c.close()
