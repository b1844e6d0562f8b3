"""Failure behaviour of the s3 tier on real sockets: nothing listening, an endpoint
that never answers, one that answers 500, and a moto server stopped mid-run under a
CacheEngine. Every case is a miss within a bound derived from the configured
timeouts, and nothing raises out of the engine."""

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
from loopback_http import LoopbackHttp, QuietHandler  # noqa: E402
from s3_server import MotoS3, set_aws_env  # noqa: E402

from lmcache_backend_s3 import S3Backend, create_s3_backend  # noqa: E402
from lmcache_core.config import load_config  # noqa: E402
from lmcache_core.engine import CacheEngine  # noqa: E402
from lmcache_core.keys import KeyNamespace  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402
from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens  # noqa: E402

FAST = {"connect_timeout_s": 0.5, "read_timeout_s": 0.5, "max_attempts": 2, "down_cooldown_s": 30}
# Per call: 2 attempts x (0.5s + 0.5s) plus botocore's backoff (< 2s for 2 attempts), with slack for 2 CPUs.
BOUND_S = 6.0
# A start-up also builds the botocore client (it parses its S3 service model: 0.2-0.5 s
# alone, seconds more on a loaded 2-CPU machine: 10.7 s seen once in a full test run);
# an unbounded start-up (botocore's defaults: 60 s connect timeouts, retried) takes minutes.
STARTUP_BOUND_S = 20.0


def make(endpoint: str, **options: Any) -> S3Backend:
    section = {"bucket": "lmc-failures", "endpoint_url": endpoint, "addressing_style": "path", **FAST, **options}
    return create_s3_backend(section, make_context())


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - t0


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    set_aws_env(monkeypatch)


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port bound on loopback with nobody listening: connections are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (kernel backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield s.getsockname()[1]
    s.close()


def test_refused_endpoint_is_a_miss_within_the_timeout(aws_env: None, refused_port: int) -> None:
    b = make(f"http://127.0.0.1:{refused_port}", verify_on_start=False)
    try:
        keys = [random_key() for _ in range(128)]
        n, dt = timed(b.contains, keys)
        assert n == 0 and dt < BOUND_S
        assert b.stats().extra["endpoint_down"] is True
        # While down, calls are misses without any request. HEADs that were already in
        # flight when the endpoint was marked down may still be counted: let them settle.
        before, deadline = -1, time.monotonic() + 5
        while b.stats().extra["requests"] != before and time.monotonic() < deadline:
            before = b.stats().extra["requests"]
            time.sleep(0.3)
        out = torch.empty(8, 8, dtype=torch.float16)
        ok, dt = timed(b.get, keys[0], out)
        assert ok is False and dt < 0.5
        assert b.put(keys[0], random_chunk(shape=(8, 8))) is False
        assert b.stats().extra["requests"] == before
    finally:
        b.close()


def test_get_and_put_against_a_refused_endpoint_return_false(aws_env: None, refused_port: int) -> None:
    b = make(f"http://127.0.0.1:{refused_port}", verify_on_start=False)
    try:
        ok, dt = timed(b.get, random_key(), torch.empty(8, 8, dtype=torch.float16))
        assert ok is False and dt < BOUND_S
    finally:
        b.close()
    b = make(f"http://127.0.0.1:{refused_port}", verify_on_start=False)
    try:
        ok, dt = timed(b.put, random_key(), random_chunk(shape=(8, 8)))
        assert ok is False and dt < BOUND_S
    finally:
        b.close()


def test_unreachable_endpoint_at_startup_is_not_fatal(aws_env: None, refused_port: int) -> None:
    b, dt = timed(make, f"http://127.0.0.1:{refused_port}")
    try:
        assert dt < STARTUP_BOUND_S
        assert b.stats().extra["endpoint_down"] is True
        assert b.contains([random_key()]) == 0
    finally:
        b.close()


def test_silent_endpoint_get_times_out_as_a_miss(aws_env: None, silent_port: int) -> None:
    b = make(f"http://127.0.0.1:{silent_port}", verify_on_start=False)
    try:
        ok, dt = timed(b.get, random_key(), torch.empty(8, 8, dtype=torch.float16))
        assert ok is False
        assert 0.5 <= dt < BOUND_S  # it waited for the read timeout, and no longer than the bound
        n, dt = timed(b.contains, [random_key()])
        assert n == 0 and dt < 0.5  # the gate is closed now
    finally:
        b.close()


class FlakyS3(LoopbackHttp):
    """A tiny HTTP server on loopback that answers 500 to the first ``fail_first``
    requests (all of them if None) and then 200, counting every request."""

    def __init__(self, fail_first: int | None) -> None:
        self.fail_first = fail_first
        self.requests: list[str] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(QuietHandler):
            def _answer(self, with_body: bool) -> None:
                with outer._lock:
                    outer.requests.append(f"{self.command} {self.path}")
                    n = len(outer.requests)
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if outer.fail_first is None or n <= outer.fail_first:
                    body = b"<?xml version='1.0'?><Error><Code>InternalError</Code><Message>boom</Message></Error>"
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if with_body:
                        self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("ETag", '"abc"')
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self) -> None:
                self._answer(False)

            def do_GET(self) -> None:
                self._answer(True)

            def do_PUT(self) -> None:
                self._answer(True)

        super().__init__(Handler)


@pytest.fixture
def flaky() -> Iterator[Any]:
    servers: list[FlakyS3] = []

    def start(fail_first: int | None) -> FlakyS3:
        servers.append(FlakyS3(fail_first))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.mark.parametrize("attempts", [1, 3])
def test_5xx_is_retried_a_bounded_number_of_times(aws_env: None, flaky: Any, attempts: int) -> None:
    server = flaky(None)
    b = make(server.endpoint, verify_on_start=False, max_attempts=attempts)
    try:
        ok, dt = timed(b.get, random_key(), torch.empty(8, 8, dtype=torch.float16))
        assert ok is False
        assert len(server.requests) == attempts
        assert all(r.startswith("GET ") for r in server.requests)
        assert b.stats().errors == 1
    finally:
        b.close()


def test_one_500_then_success_is_retried_transparently(aws_env: None, flaky: Any) -> None:
    server = flaky(1)
    b = make(server.endpoint, verify_on_start=False, max_attempts=3)
    try:
        assert b.contains([random_key()]) == 1  # the server answers 200 to HEAD after one 500
        assert [r.split()[0] for r in server.requests] == ["HEAD", "HEAD"]
        assert b.stats().extra["endpoint_down"] is False
    finally:
        b.close()


def test_endpoint_stopped_mid_run_gives_misses_not_exceptions(monkeypatch: pytest.MonkeyPatch) -> None:
    set_aws_env(monkeypatch)
    server = MotoS3()
    try:
        bucket = server.make_bucket()
        section = server.section(bucket, **FAST)
        cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "8MiB"}, section]})
        tokens = list(range(64))
        chunks = [random_chunk(shape=(2, 16, 8), seed=i) for i in range(4)]
        with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as a:
            assert store_tokens(a, tokens, chunks) == 4
            assert a.flush(timeout=30)
        with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as b:
            assert lookup_tokens(b, tokens) == 64  # from the bucket: b's CPU tier is empty
            server.stop()
            outs = [torch.empty_like(c) for c in chunks]
            n, dt = timed(retrieve_tokens, b, tokens, outs)
            assert n == 0 and dt < BOUND_S
            n, dt = timed(lookup_tokens, b, tokens)
            assert n == 0 and dt < BOUND_S
            n, dt = timed(lookup_tokens, b, list(range(100, 164)))
            assert n == 0 and dt < BOUND_S
            assert store_tokens(b, list(range(200, 232)), chunks[:2]) == 2  # the CPU tier still works
            assert b.flush(timeout=BOUND_S)
            s3_stats = [t for t in b.stats()["tiers"] if t["name"] == "s3"][0]  # type: ignore[union-attr]
            assert s3_stats["extra"]["endpoint_down"] is True
            assert lookup_tokens(b, list(range(200, 232))) == 32
    finally:
        server.stop()


def test_silent_endpoint_never_blocks_store_on_the_engine(aws_env: None, silent_port: int) -> None:
    """The engine writes the s3 tier in the background: store() returns long before the
    tier's read timeout, and the first tier serves the chunks meanwhile."""
    slow = {**FAST, "read_timeout_s": 2.0, "verify_on_start": False}
    section = {"name": "s3", "bucket": "lmc-failures", "endpoint_url": f"http://127.0.0.1:{silent_port}", **slow}
    cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "8MiB"}, section]})
    chunks = [random_chunk(shape=(2, 16, 8), seed=i) for i in range(4)]
    with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as engine:
        stored, dt = timed(store_tokens, engine, list(range(64)), chunks)
        assert stored == 4 and dt < 1.5
        outs = [torch.empty_like(c) for c in chunks]
        assert retrieve_tokens(engine, list(range(64)), outs) == 4
        assert all(torch.equal(o, c) for o, c in zip(outs, chunks))
        assert engine.flush(timeout=30)  # the background puts end as timeouts, counted, not raised
        s3 = [t for t in engine.stats()["tiers"] if t["name"] == "s3"][0]  # type: ignore[union-attr]
        assert s3["puts"] == 0 and s3["extra"]["endpoint_down"] is True
