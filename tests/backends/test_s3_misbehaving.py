"""The s3 tier against an endpoint that misbehaves in what it sends (a tiny HTTP
server on loopback; moto answers correctly, so it cannot play these):

- a GET whose body is far longer than its headers say (chunked, no Content-Length):
  the tier reads at most the largest frame the caller's chunk can have, one byte
  more, and misses; the memory the read takes is bounded by the chunk, not by the
  peer. Control: a valid frame sent the same way (chunked) is a hit;
- a corrupt object on an endpoint whose DELETE hangs, with ``delete_corrupt``: the
  delete runs under ``op_deadline_s`` like every other request, so the read that
  found the object returns within the deadline and the overrun is counted. Control:
  the DELETE was sent (the test would pass vacuously if it were not)."""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from loopback_http import LoopbackHttp, QuietHandler  # noqa: E402
from s3_server import set_aws_env  # noqa: E402

from lmcache_backend_s3 import S3Backend, create_s3_backend  # noqa: E402
from lmcache_core.serde import encode  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

MiB = 1 << 20


class OddS3(LoopbackHttp):
    """Answers every GET with ``body`` (chunked, in 1 MiB pieces, ``repeat`` times)
    under a Content-Range that claims ``claimed`` bytes, and every DELETE after
    ``delete_delay_s``. Records the request methods."""

    def __init__(self, body: bytes, claimed: int, repeat: int = 1, delete_delay_s: float = 0.0) -> None:
        self.requests: list[str] = []
        self.sent = 0
        outer = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.requests.append("GET")
                self.send_response(206)
                self.send_header("Content-Range", f"bytes 0-{claimed - 1}/{claimed}")
                self.send_header("ETag", '"e"')
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for _ in range(repeat):
                        for i in range(0, len(body), MiB):
                            piece = body[i : i + MiB]
                            self.wfile.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                            outer.sent += len(piece)
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass  # the reader hung up: what this test wants to see

            def do_DELETE(self) -> None:
                outer.requests.append("DELETE")
                time.sleep(delete_delay_s)
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

        super().__init__(Handler)


@pytest.fixture
def odd(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    set_aws_env(monkeypatch)
    servers: list[OddS3] = []

    def start(*args: Any, **kw: Any) -> OddS3:
        servers.append(OddS3(*args, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def tier(endpoint: str, **options: Any) -> S3Backend:
    section = {
        "bucket": "lmc-odd",
        "endpoint_url": endpoint,
        "addressing_style": "path",
        "verify_on_start": False,
        "max_attempts": 1,
        **options,
    }
    return create_s3_backend(section, make_context())


def test_a_body_longer_than_its_headers_say_is_read_only_up_to_the_chunks_bound(odd: Any) -> None:
    server = odd(b"\0" * MiB, claimed=64, repeat=64)  # 64 MiB, under headers that claim 64 bytes
    b = tier(server.endpoint, op_deadline_s=30)
    try:
        out = torch.empty(16, dtype=torch.float16)  # its largest frame: a few KiB
        tracemalloc.start()
        try:
            ok = b.get(random_key(), out)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert ok is False and b.stats().misses == 1
        assert peak < 8 * MiB, f"the read held {peak / MiB:.1f} MiB for a 32-byte chunk"
    finally:
        b.close()


def test_a_valid_frame_sent_chunked_is_a_hit(odd: Any) -> None:
    """The control: reading at most the bound still reads a whole body that has no
    Content-Length."""
    key, data = random_key(), random_chunk(shape=(64, 64))
    frame = encode(key, data, make_context().codec)
    server = odd(frame, claimed=len(frame))
    b = tier(server.endpoint)
    try:
        out = torch.empty_like(data)
        assert b.get(key, out) is True and torch.equal(out, data)
    finally:
        b.close()


def test_delete_corrupt_is_bounded_by_the_operation_deadline(odd: Any) -> None:
    server = odd(b"\0" * 64, claimed=64, delete_delay_s=6.0)  # not a frame; DELETE answers after 6 s
    b = tier(server.endpoint, op_deadline_s=1.0, read_timeout_s=10, delete_corrupt=True)
    try:
        t0 = time.monotonic()
        ok = b.get(random_key(), torch.empty(16, dtype=torch.float16))
        took = time.monotonic() - t0
        assert ok is False and b.stats().extra["corrupt"] == 1
        assert server.requests == ["GET", "DELETE"]  # control: the delete was asked for
        assert took < 4.0, f"get took {took:.1f}s with op_deadline_s=1"
        assert b.stats().extra["deadline_overruns"] == 1
    finally:
        b.close()
