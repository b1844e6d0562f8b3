"""Every S3 operation ends within ``op_deadline_s`` whatever the server does. A
raw-socket server on 127.0.0.1 answers slowly but steadily (a few bytes every fraction
of a second, each read well under botocore's read timeout): the response body (get) or
the response headers (lookup, put). Each call must be a miss within deadline + margin,
trip the health gate, and (body case) free its connection at the deadline. Negative
control: the same server answering at full speed serves a hit, so the misses come from
the deadline, not a bad response."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import set_aws_env  # noqa: E402

from lmcache_backend_s3 import S3Backend, create_s3_backend  # noqa: E402
from lmcache_core.config import load_config  # noqa: E402
from lmcache_core.engine import CacheEngine  # noqa: E402
from lmcache_core.keys import ChunkKey, KeyNamespace  # noqa: E402
from lmcache_core.serde import RawCodec, encode  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402
from lmcache_core.testing.tokens import retrieve_tokens  # noqa: E402

DEADLINE_S = 1.5
MARGIN_S = 0.75  # scheduling slack on 2 shared CPUs
# Per-read timeout far above the trickle period: botocore alone would never give up.
OPTS = {
    "op_deadline_s": DEADLINE_S,
    "read_timeout_s": 5.0,
    "connect_timeout_s": 1.0,
    "max_attempts": 1,
    "down_cooldown_s": 30,
    "verify_on_start": False,
}


class TrickleS3:
    """Answers every request on its own thread. ``mode``: ``fast`` (whole answer at
    once), ``body`` (headers at once, body ``step`` bytes every ``period``), or
    ``headers`` (the response headers themselves trickled)."""

    def __init__(self, mode: str, obj: bytes = b"", step: int = 8, period: float = 0.2) -> None:
        self.mode, self.obj, self.step, self.period = mode, obj, step, period
        self.requests: list[str] = []
        self.cut_at: list[float] = []  # when a trickled send found the client gone
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(32)
        self._sock.settimeout(0.1)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                s, _ = self._sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _read_request(self, f: Any) -> tuple[str, dict[str, str]] | None:
        line = f.readline()
        if not line:
            return None
        headers = {}
        while True:
            h = f.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length") or 0)
        if n:
            f.read(n)
        return line.decode().strip(), headers

    def _trickle(self, s: socket.socket, data: bytes, step: int) -> None:
        for i in range(0, len(data), step):
            if self._stop.is_set():
                return
            try:
                s.sendall(data[i : i + step])
            except OSError:
                self.cut_at.append(time.monotonic())
                return
            time.sleep(self.period)

    def _serve(self, s: socket.socket) -> None:
        f = s.makefile("rb")
        try:
            while not self._stop.is_set():
                req = self._read_request(f)
                if req is None:
                    return
                line, _ = req
                self.requests.append(line)
                method = line.split()[0]
                body = self.obj if method == "GET" else b""
                status = "206 Partial Content" if method == "GET" else "200 OK"
                head = (
                    f'HTTP/1.1 {status}\r\nETag: "e1"\r\nContent-Length: {len(body)}\r\n'
                    + (f"Content-Range: bytes 0-{len(body) - 1}/{len(body)}\r\n" if method == "GET" else "")
                    + "\r\n"
                ).encode()
                if self.mode == "fast" or (self.mode == "body" and method != "GET"):
                    s.sendall(head + (body if method != "HEAD" else b""))
                elif self.mode == "body":
                    s.sendall(head)
                    self._trickle(s, body, self.step)
                    return
                else:
                    self._trickle(s, head, 1)
                    return
        except OSError:
            pass
        finally:
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def trickle(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    set_aws_env(monkeypatch)
    servers: list[TrickleS3] = []

    def start(mode: str, obj: bytes = b"", **kw: Any) -> TrickleS3:
        servers.append(TrickleS3(mode, obj, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def backend(endpoint: str) -> S3Backend:
    section = {"bucket": "lmc-deadline", "endpoint_url": endpoint, "addressing_style": "path", **OPTS}
    return create_s3_backend(section, make_context())


def chunk_and_frame() -> tuple[ChunkKey, torch.Tensor, bytes]:
    key, data = random_key(), random_chunk(shape=(32, 64), seed=3)
    return key, data, encode(key, data, RawCodec())


def test_fast_answer_is_a_hit_negative_control(trickle: Any) -> None:
    key, data, frame = chunk_and_frame()
    server = trickle("fast", frame)
    b = backend(server.endpoint)
    try:
        out = torch.empty_like(data)
        assert b.get(key, out) is True and torch.equal(out, data)
        assert b.contains([key]) == 1
        assert b.stats().extra["deadline_overruns"] == 0
    finally:
        b.close()


def test_trickled_body_get_ends_at_the_deadline_and_frees_the_connection(trickle: Any) -> None:
    key, data, frame = chunk_and_frame()
    server = trickle("body", frame, step=8, period=0.2)  # ~8 KiB at 40 B/s: minutes without a deadline
    b = backend(server.endpoint)
    try:
        out = torch.zeros_like(data)
        t0 = time.monotonic()
        ok = b.get(key, out)
        dt = time.monotonic() - t0
        assert ok is False and DEADLINE_S - 0.1 <= dt < DEADLINE_S + MARGIN_S, dt
        assert torch.count_nonzero(out) == 0  # nothing written into the caller's tensor
        extra = b.stats().extra
        assert extra["deadline_overruns"] == 1 and extra["endpoint_down"] is True
        # The gate is closed: the next calls are misses without a request.
        n_req = len(server.requests)
        t1 = time.monotonic()
        assert b.get(key, out) is False and b.contains([key]) == 0
        assert time.monotonic() - t1 < 0.2 and len(server.requests) == n_req
        # The watchdog cut the socket at the deadline: the server's next send fails.
        end = time.monotonic() + 3
        while not server.cut_at and time.monotonic() < end:
            time.sleep(0.05)
        assert server.cut_at and server.cut_at[0] - t0 < DEADLINE_S + 1.0, server.cut_at
    finally:
        b.close()


@pytest.mark.parametrize("op", ["lookup", "put"])
def test_trickled_headers_end_lookup_and_put_at_the_deadline(trickle: Any, op: str) -> None:
    key, data, _ = chunk_and_frame()
    server = trickle("headers", period=0.3)  # ~100 header bytes at 3 B/s
    b = backend(server.endpoint)
    try:
        t0 = time.monotonic()
        result = b.contains([key]) if op == "lookup" else b.put(key, data)
        dt = time.monotonic() - t0
        assert result in (0, False) and dt < DEADLINE_S + MARGIN_S, dt
        assert b.stats().extra["deadline_overruns"] == 1 and b.stats().extra["endpoint_down"] is True
    finally:
        b.close()


def test_engine_retrieve_from_a_trickling_endpoint_ends_within_the_deadline(trickle: Any) -> None:
    key, data, frame = chunk_and_frame()
    server = trickle("body", frame, step=8, period=0.2)
    section = {"name": "s3", "bucket": "lmc-deadline", "endpoint_url": server.endpoint, "addressing_style": "path", **OPTS}
    cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "8MiB"}, section]})
    with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as engine:
        outs = [torch.empty(32, 64) for _ in range(3)]
        t0 = time.monotonic()
        n = retrieve_tokens(engine, list(range(48)), outs)
        dt = time.monotonic() - t0
        # The first chunk's get meets the deadline; the gate makes the rest instant misses.
        assert n == 0 and dt < DEADLINE_S + MARGIN_S, dt


def test_op_deadline_is_validated() -> None:
    from lmcache_core.config import ConfigError

    with pytest.raises(ConfigError, match="op_deadline_s"):
        create_s3_backend({"bucket": "lmc-deadline", "op_deadline_s": 0, "verify_on_start": False}, make_context())
