"""A TCP proxy on loopback that adds a fixed delay each way: a network of a given
round-trip time for the shared tiers (Redis, a peer node over TCP, S3), where the
machines have no ``netem``.

Every byte read on one side is written to the other side ``rtt / 2`` seconds later,
in order, so a pipelined or parallel protocol pays the delay once per exchange and a
one-request-at-a-time protocol once per request, as on a real link. Bandwidth is not
limited, but what is in flight is, as a TCP window limits it: each direction of a
connection holds at most ``window`` bytes read and not yet written (default
:data:`WINDOW_BYTES`); past it the proxy stops reading that side until the other side
takes them. So one connection carries at most ``window / (rtt / 2)`` bytes a second
(4 MiB: 420 MB/s at 20 ms, 8.4 GB/s at 1 ms), a peer that stops reading holds the
sender back instead of filling the proxy's memory, and the proxy holds at most
``2 * window`` per connection. At most ``max_connections`` connections (default
:data:`MAX_CONNECTIONS`) are relayed at once, four threads each; one more is closed
at once, unrelayed (counted in ``refused``).

    with LatencyProxy(("127.0.0.1", 6379), rtt_ms=20) as proxy:
        ...  # connect to proxy.address instead of 127.0.0.1:6379

``python bench/lib/latency_proxy.py TARGET_HOST:PORT RTT_MS`` runs one in the foreground
and prints its address (``--window-mib``, ``--max-connections``: the bounds above);
``python bench/lib/latency_proxy.py --self-check`` prints what the relay costs on this host
(126 MiB and a ping, straight and at 0, 1 and 20 ms).
"""

from __future__ import annotations

import argparse
import collections
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

RECV_BYTES = 4 << 20  # the most one read takes off a socket
WINDOW_BYTES = 4 << 20  # the most one direction of a connection holds, read and not yet written
MAX_CONNECTIONS = 64  # connections relayed at once (four threads each)


class _Pipe:
    """One direction of one connection: a reader thread takes what ``src`` sends and
    stamps it; a writer thread sends each piece to ``dst`` ``one_way`` seconds after
    it arrived, in order, then half-closes ``dst`` after ``src``'s end. Plain blocking
    sockets: each thread waits in the kernel without the GIL, and a piece is copied
    once in user space (the asyncio relay this replaces copied it through two stream
    buffers and ran both directions of every connection on one thread).

    Backpressure: the reader takes at most ``window`` bytes more than the writer has
    sent, then waits for the writer, so a ``dst`` that stops reading stops ``src``
    (its kernel buffers fill and its sends block) instead of growing the queue. A
    writer that fails (``dst`` broken) shuts both sockets down: the connection ends."""

    def __init__(
        self, src: socket.socket, dst: socket.socket, one_way: float, name: str, done: Any, window: int = WINDOW_BYTES
    ) -> None:
        self.src, self.dst, self.one_way, self._done = src, dst, one_way, done
        self.window = max(1, window)
        self.held = 0  # bytes read and not yet written
        self.peak = 0
        self._ended = False  # the writer has finished: the reader stops
        self._q: collections.deque[tuple[float, bytes]] = collections.deque()
        self._cv = threading.Condition()
        self.threads = [
            threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
            threading.Thread(target=self._write, name=f"{name}-write", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        try:
            while True:
                with self._cv:
                    while self.held >= self.window and not self._ended:
                        self._cv.wait()
                    if self._ended:
                        return
                    room = self.window - self.held
                data = self.src.recv(min(RECV_BYTES, room))
                with self._cv:
                    self._q.append((time.monotonic() + self.one_way, data))
                    self.held += len(data)
                    self.peak = max(self.peak, self.held)
                    self._cv.notify_all()
                if not data:
                    return
        except OSError:  # the connection broke: the writer finishes
            with self._cv:
                self._q.append((0.0, b""))
                self._cv.notify_all()

    def _write(self) -> None:
        try:
            self._deliver()
        finally:
            with self._cv:
                self._ended = True
                self._q.clear()
                self.held = 0
                self._cv.notify_all()
            self._done()

    def _deliver(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                due, data = self._q.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
            except OSError:  # dst is gone: so is the connection (wakes the reader and the other direction)
                for s in (self.src, self.dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            with self._cv:
                self.held -= len(data)
                self._cv.notify_all()


class _Proxy:
    """What both proxies offer: ``start``/``stop``, a context manager, ``address``;
    their settings: the upstream ``target``, the round trip added, the relay's window
    and its connection cap."""

    def __init__(
        self,
        target: tuple[str, int],
        rtt_ms: float,
        window: int = WINDOW_BYTES,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.target, self.rtt_ms = target, rtt_ms
        self.window, self.max_connections = window, max_connections
        self.address: tuple[str, int] = ("127.0.0.1", 0)

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url_host_port(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


class Relay(_Proxy):
    """The relay itself, in this process (what the child process of
    :class:`LatencyProxy` runs)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.one_way = max(0.0, self.rtt_ms) / 2000.0
        self.connections = 0  # accepted and relayed
        self.refused = 0  # accepted past max_connections and closed at once
        self.active = 0
        self.pipes: list[_Pipe] = []  # the open connections' (for peak_held)
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = False

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> "Relay":
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.2)
        self._listener = listener
        self.address = listener.getsockname()[:2]
        accept = threading.Thread(target=self._accept_loop, name="latency-proxy", daemon=True)
        self._threads.append(accept)
        accept.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection; join every thread (bounded)."""
        if self._listener is None:
            return
        self._stopping = True
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        for s in socks:
            s.close()
        self._listener.close()
        self._listener = None

    # -- the proxy ----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                full = self.active >= self.max_connections
                if not full:
                    self.active += 1
            if full:
                self.refused += 1
                client.close()
                continue
            self.connections += 1
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                with self._lock:
                    self.active -= 1
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            n = self.connections
            pipes: list[_Pipe] = []
            done = self._closer(client, upstream, pipes)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._sockets |= {client, upstream}
                pipes += [
                    _Pipe(client, upstream, self.one_way, f"proxy{n}-up", done, self.window),
                    _Pipe(upstream, client, self.one_way, f"proxy{n}-down", done, self.window),
                ]
                self.pipes += pipes
                self._threads += [t for p in pipes for t in p.threads]

    def peak_held(self) -> int:
        """The most bytes one direction of an open connection has held at once."""
        with self._lock:
            return max((p.peak for p in self.pipes), default=0)

    def _closer(self, a: socket.socket, b: socket.socket, pipes: list[_Pipe]) -> Any:
        """Called once per direction when its writer finishes: the second call closes
        both sockets (which also ends a reader still waiting on either) and frees the
        connection's slot."""
        left = [2]

        def done() -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
                self._sockets -= {a, b}
                self.active -= 1
                self.pipes = [p for p in self.pipes if p not in pipes]
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

        return done


class LatencyProxy(_Proxy):
    """The proxy the benchmarks use: the relay in a child process of its own, so that
    its threads never wait for the GIL behind the benchmark's own Python threads (the
    engine, a tier client parsing responses), as a network would not.
    ``in_process=True`` runs :class:`Relay` here instead."""

    def __init__(self, *args: Any, in_process: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._relay = Relay(self.target, self.rtt_ms, self.window, self.max_connections) if in_process else None
        self._proc: subprocess.Popen[str] | None = None

    @property
    def connections(self) -> int | None:
        """Connections accepted (in process only; None for the child process)."""
        return self._relay.connections if self._relay is not None else None

    @property
    def pid(self) -> int | None:
        """The child process's (None in process)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> "LatencyProxy":
        if self._relay is not None:
            self.address = self._relay.start().address
            return self
        host, port = self.target
        args = [f"{host}:{port}", str(self.rtt_ms), "--window-mib", str(self.window / (1 << 20))]
        args += ["--max-connections", str(self.max_connections)]
        self._proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], 30)
        line = self._proc.stdout.readline() if ready else ""
        if not line.startswith("proxy "):
            self.stop()
            raise RuntimeError(f"latency proxy did not start: {line!r}")
        h, _, p = line.split()[1].rpartition(":")
        self.address = (h, int(p))
        return self

    def stop(self) -> None:
        if self._relay is not None:
            self._relay.stop()
            return
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None


def loopback_server(handle: Any) -> tuple[socket.socket, tuple[str, int]]:
    """A server on 127.0.0.1 running ``handle(connection)`` on a thread per connection
    (closed after it); close the returned socket to stop accepting."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run(c: socket.socket) -> None:
        with c:
            handle(c)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=run, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[:2]


def _bulk_server(payload: bytes) -> tuple[socket.socket, tuple[str, int]]:
    """Answers each ``B`` with ``payload`` and each ``p`` with one byte."""

    def handle(c: socket.socket) -> None:
        while req := c.recv(16):
            c.sendall(payload if req.startswith(b"B") else b"p")

    return loopback_server(handle)


def timed_exchanges(sock: socket.socket, request: bytes, size: int, rounds: int) -> list[float]:
    """Seconds of each of ``rounds`` exchanges on ``sock``: ``request`` sent, exactly
    ``size`` bytes of answer received into one buffer (no copy out of it)."""
    buf = memoryview(bytearray(size))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sock.sendall(request)
        got = 0
        while got < size:
            n = sock.recv_into(buf[got:])
            if not n:
                raise ConnectionError("the server closed the connection")
            got += n
        times.append(time.perf_counter() - t)
    return times


def _fetch(addr: tuple[str, int], size: int, tries: int = 3) -> float:
    """Fastest of ``tries`` request/response exchanges of ``size`` bytes (1: a ping)."""
    with socket.create_connection(addr, timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return min(timed_exchanges(s, b"B" if size > 1 else b"p", size, tries))


def self_check(mib: int = 126, rtts: tuple[float, ...] = (0, 1, 20)) -> None:
    """What the relay costs on this host: ``mib`` MiB and a one-byte ping, straight and
    through the proxy at each round trip."""
    size = mib << 20
    srv, addr = _bulk_server(b"x" * size)
    with srv:
        print(
            f"window {WINDOW_BYTES >> 20} MiB per direction: at most {WINDOW_BYTES / 0.01 / 1e9:.2f} GB/s a connection at 20 ms"
        )
        print(f"direct: {mib} MiB {_fetch(addr, size) * 1000:.1f} ms, ping {_fetch(addr, 1) * 1000:.2f} ms")
        for rtt in rtts:
            with LatencyProxy(addr, rtt) as proxy:
                big, ping = _fetch(proxy.address, size), _fetch(proxy.address, 1)
            print(f"rtt {rtt:g} ms: {mib} MiB {big * 1000:.1f} ms ({size / big / 1e9:.2f} GB/s), ping {ping * 1000:.2f} ms")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--self-check"]:
        self_check()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="HOST:PORT to relay to")
    ap.add_argument("rtt_ms", type=float, help="round trip to add (ms)")
    ap.add_argument("--window-mib", type=float, default=WINDOW_BYTES / (1 << 20), help="bytes in flight per direction (MiB)")
    ap.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, help="connections relayed at once")
    a = ap.parse_args(argv)
    host, _, port = a.target.rpartition(":")
    window = max(1, int(a.window_mib * (1 << 20)))
    with Relay((host or "127.0.0.1", int(port)), a.rtt_ms, window, max(1, a.max_connections)) as proxy:
        print(
            f"proxy {proxy.url_host_port} -> {a.target} at {a.rtt_ms:g} ms round trip, window {a.window_mib:g} MiB, "
            f"at most {proxy.max_connections} connections",
            flush=True,
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
