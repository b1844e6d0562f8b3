"""Fault injectors for the soak: an S3 endpoint that can be stopped, slowed, made to
answer 5xx or to trickle, and disk faults (corrupted chunk files, a full disk).

:class:`S3FaultProxy` is a TCP proxy on 127.0.0.1 in front of a real S3 server (moto);
nothing in it but ``5xx`` is HTTP, so other tests put it in front of any TCP server
(Redis, a peer node) as :data:`TcpFaultProxy`. Its mode applies to connections
accepted after a switch; a switch closes every open connection, so pooled keep-alive
connections cannot carry the old mode on. ``stall``: the server's first
``stall_after`` bytes on each connection go through, then nothing more (the
connection stays open): a reply cut off mid-way by a dead link.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

MODES = ("ok", "stopped", "slow", "5xx", "trickle", "stall")
_5XX_BODY = b"<?xml version='1.0'?><Error><Code>ServiceUnavailable</Code><Message>injected by the soak</Message></Error>"


class S3FaultProxy:
    def __init__(
        self, upstream: tuple[str, int], slow_s: float = 0.2, trickle: tuple[int, float] = (16, 0.1), stall_after: int = 1024
    ) -> None:
        self.upstream = upstream
        self.slow_s = slow_s
        self.stall_after = stall_after
        self.trickle_step, self.trickle_period = trickle
        self.mode = "ok"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self._sock.settimeout(0.2)
        self.address = ("127.0.0.1", self._sock.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.address[1]}"
        self._thread = threading.Thread(target=self._accept, name="soak-s3-proxy", daemon=True)
        self._thread.start()

    def set_mode(self, mode: str) -> None:
        assert mode in MODES, mode
        with self._lock:
            self.mode = mode
            socks, self._open = list(self._open), set()
        for s in socks:
            _close(s)

    def _track(self, s: socket.socket) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._open.add(s)
            return True

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._sock.accept()
            except OSError:
                continue
            mode = self.mode
            if mode == "stopped" or not self._track(c):
                _close(c)
                continue
            threading.Thread(target=self._serve, args=(c, mode), daemon=True).start()

    def _serve(self, c: socket.socket, mode: str) -> None:
        if mode == "5xx":
            self._answer_5xx(c)
            return
        try:
            u = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _close(c)
            return
        if not self._track(u):
            _close(c)
            _close(u)
            return
        threading.Thread(target=self._pump, args=(c, u, "ok"), daemon=True).start()
        self._pump(u, c, mode)

    def _pump(self, src: socket.socket, dst: socket.socket, mode: str) -> None:
        sent = 0
        try:
            src.settimeout(30)
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if mode == "stall":
                    data = data[: max(0, self.stall_after - sent)]
                    sent += len(data)
                    if data:
                        dst.sendall(data)
                    if sent >= self.stall_after:
                        self._stop.wait()  # hold the connection open, silent, until closed
                        break
                elif mode == "slow":
                    time.sleep(self.slow_s)
                    dst.sendall(data)
                elif mode == "trickle":
                    for i in range(0, len(data), self.trickle_step):
                        if self._stop.is_set():
                            break
                        dst.sendall(data[i : i + self.trickle_step])
                        time.sleep(self.trickle_period)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def _answer_5xx(self, c: socket.socket) -> None:
        """Read one request (headers and body) and answer 503, closing."""
        try:
            c.settimeout(5)
            buf = b""
            while b"\r\n\r\n" not in buf and len(buf) < 65536:
                chunk = c.recv(65536)
                if not chunk:
                    return
                buf += chunk
            head, _, rest = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v.strip() or 0)
            left = length - len(rest)
            while left > 0:
                chunk = c.recv(min(left, 65536))
                if not chunk:
                    return
                left -= len(chunk)
            c.sendall(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(_5XX_BODY)}\r\nConnection: close\r\n\r\n".encode()
                + _5XX_BODY
            )
        except (OSError, ValueError):
            pass
        finally:
            _close(c)

    def close(self) -> None:
        self._stop.set()
        self.set_mode("stopped")
        self._thread.join(timeout=5)
        self._sock.close()


TcpFaultProxy = S3FaultProxy


def timed_call(fn: Callable[[], Any], limit_s: float = 60.0) -> tuple[Any, float]:
    """``fn()`` on a thread, with its duration: for calls made through a faulty link, so
    a call still running after ``limit_s`` fails the test instead of hanging it."""
    result: list[Any] = []
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), f"the call was still running after {limit_s:.0f} s"
    return result[0], time.monotonic() - t0


class ChildFaultProxy:
    """A :class:`TcpFaultProxy` in a child process, driven over its stdin. For clients
    whose native calls hold the GIL while they wait on the network (Mooncake's): an
    in-process proxy could then never pass a byte and the test would measure a
    deadlock of its own making, not the client."""

    def __init__(self, upstream: tuple[str, int], trickle: tuple[int, float] = (16, 0.1), stall_after: int = 1024) -> None:
        import subprocess
        import sys

        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); from faults import TcpFaultProxy\n"
            "p = TcpFaultProxy((sys.argv[2], int(sys.argv[3])), trickle=(int(sys.argv[4]), float(sys.argv[5])),"
            " stall_after=int(sys.argv[6]))\n"
            "print(p.address[1], flush=True)\n"
            "for line in sys.stdin:\n"
            "    p.set_mode(line.strip()); print('ok', flush=True)\n"
            "p.close()\n"
        )
        args = [str(Path(__file__).parent), upstream[0], str(upstream[1]), str(trickle[0]), str(trickle[1]), str(stall_after)]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None and self._proc.stdin is not None
        self.address = ("127.0.0.1", int(self._proc.stdout.readline()))

    def set_mode(self, mode: str) -> None:
        assert mode in MODES, mode
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(mode + "\n")
        self._proc.stdin.flush()
        assert self._proc.stdout.readline().strip() == "ok"

    def close(self) -> None:
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except Exception:
            self._proc.kill()
            self._proc.wait()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def corrupt_files(root: Path, n: int, rng: random.Random) -> int:
    """Flip one byte in the middle of up to ``n`` chunk files under ``root``; returns
    how many were corrupted."""
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    done = 0
    for p in rng.sample(files, min(n, len(files))):
        try:
            size = p.stat().st_size
            if size < 2:
                continue
            fd = os.open(p, os.O_RDWR)
            try:
                off = size // 2 + rng.randrange(0, max(1, size // 4))
                b = os.pread(fd, 1, off)
                if b:
                    os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
                    done += 1
            finally:
                os.close(fd)
        except OSError:
            continue  # evicted or replaced meanwhile
    return done


def fill_disk(path: Path, limit: int = 1 << 30) -> int:
    """Write zeros to ``path`` until the filesystem is full (ENOSPC) or ``limit``
    bytes; returns bytes written."""
    written = 0
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while written < limit:
            try:
                written += f.write(block)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                # Fill the last partial block too.
                for size in (65536, 4096, 512):
                    while True:
                        try:
                            written += f.write(b"\0" * size)
                        except OSError:
                            break
                break
    return written
