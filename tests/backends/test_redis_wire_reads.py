"""The Redis tier's batched reads parse replies themselves (``wire.read_ranges``) and
receive each value straight into its own buffer. These tests check that the parser
gives what redis-py gives on a real server (hits, missing keys, a value of the wrong
type, a value longer than was asked for) and that replies no real server sends
(a value longer than asked for, a huge or malformed length, an endless line, a reply
cut off, unknown reply types) end as an error within bounded time and memory, with
the connection dropped, never a hang or a half-read connection back in the pool. The
fake server speaks just enough RESP to be connected to; it stands for a hostile or
broken server, which a real ``redis-server`` cannot be made to be."""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis
import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

sys.path.insert(0, str(Path(__file__).parent))
from memtrace import peak_python_bytes  # noqa: E402
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixture

from lmcache_backend_redis import create_redis_backend  # noqa: E402
from lmcache_backend_redis.client import DeadlinePool, call_deadline  # noqa: E402
from lmcache_backend_redis.wire import read_ranges  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402


def _pool(port: int) -> DeadlinePool:
    return DeadlinePool(host="127.0.0.1", port=port, max_connections=2, timeout=5, socket_timeout=5)


# -- against a real server: the same answers as redis-py's pipeline -------------------------
def test_replies_match_redis_py_on_a_real_server(redis_server: RedisServer) -> None:
    raw = redis_server.client()
    raw.set("v:small", b"abc")
    raw.set("v:big", b"x" * 300_000)
    raw.set("v:empty", b"")
    raw.rpush("v:list", b"item")
    names = [b"v:small", b"v:big", b"v:missing", b"v:empty", b"v:list"]
    limits = [100, 200_000, 100, 100, 100]
    pool = _pool(redis_server.port)
    try:
        ours = read_ranges(pool, names, limits)
        pipe = redis.Redis(connection_pool=pool).pipeline(transaction=False)
        for n, lim in zip(names, limits):
            pipe.strlen(n)
            pipe.getrange(n, 0, lim - 1)
        theirs = pipe.execute(raise_on_error=False)
    finally:
        pool.disconnect()
    assert len(ours) == len(theirs) == 2 * len(names)
    for a, b in zip(ours, theirs):
        if isinstance(b, Exception):
            assert isinstance(a, Exception) and str(a) == str(b) and str(a).startswith("WRONGTYPE")
        else:
            assert a == b, (a[:20] if isinstance(a, bytearray) else a, b[:20] if isinstance(b, bytes) else b)
    assert ours[2] == 300_000 and len(ours[3]) == 200_000  # STRLEN says the whole, GETRANGE the asked part


def test_a_pooled_connection_with_unread_bytes_is_not_used(redis_server: RedisServer) -> None:
    raw = redis_server.client()
    raw.set("u:a", b"value-a")
    pool = _pool(redis_server.port)
    try:
        conn = pool.get_connection()
        conn.send_command("PING")  # its +PONG is left unread: a broken earlier user
        time.sleep(0.2)
        assert conn.can_read(timeout=0.5)  # control: the stray reply is there
        pool.release(conn)
        out = read_ranges(pool, [b"u:a"], [100])
        assert out == [7, bytearray(b"value-a")]
    finally:
        pool.disconnect()


def test_the_tier_reads_chunks_through_it(redis_server: RedisServer) -> None:
    tier = create_redis_backend({"url": redis_server.url, "prefix": "wire:"}, make_context())
    try:
        keys = [random_key() for _ in range(5)]
        chunks = [random_chunk(shape=(64, 256), seed=i) for i in range(5)]
        assert all(tier.put_many(list(zip(keys[:4], chunks[:4]))))
        outs = [torch.empty_like(c) for c in chunks]
        assert tier.get_many(keys, outs) == [True, True, True, True, False]
        assert all(torch.equal(o, c) for o, c in zip(outs[:4], chunks[:4]))
    finally:
        tier.close()


def test_a_batch_read_holds_one_frame_not_one_per_key(redis_server: RedisServer) -> None:
    """get_many judges each value as it arrives, in one scratch buffer: reading 24
    chunks of 512 KiB allocates about one frame's worth of Python memory, not 24 (the
    values used to be kept, each in a buffer of its own, until the last arrived)."""
    tier = create_redis_backend({"url": redis_server.url, "prefix": "onebuf:"}, make_context())
    try:
        keys = [random_key() for _ in range(24)]
        chunks = [random_chunk(shape=(256, 1024), seed=i) for i in range(24)]  # 512 KiB each (fp16)
        assert all(tier.put_many(list(zip(keys, chunks))))
        outs = [torch.empty_like(c) for c in chunks]
        tier.get_many(keys[:1], outs[:1])  # connect before measuring
        hits, peak = peak_python_bytes(lambda: tier.get_many(keys, outs))
        assert hits == [True] * 24 and all(torch.equal(o, c) for o, c in zip(outs, chunks))
        assert peak < 4 * chunks[0].nbytes, f"peak {peak / 2**20:.1f} MiB of Python memory for 24 x 512 KiB"
        assert tier.stats().hits == 25  # each hit counted once
    finally:
        tier.close()


# -- against a broken or hostile server ------------------------------------------------------
def _setup_replies(buf: bytes) -> bytes:
    """Replies to the commands redis-py sends on connecting: ``HELLO 3`` (a RESP3 map
    saying protocol 3) and ``+OK`` for anything else (``CLIENT SETINFO`` ...)."""
    out = b""
    for cmd in re.split(rb"(?:^|(?<=\r\n))(?=\*\d+\r\n)", buf):
        if not cmd:
            continue
        out += b"%1\r\n$5\r\nproto\r\n:3\r\n" if b"HELLO" in cmd else b"+OK\r\n"
    return out


class FakeServer:
    """Answers ``+OK`` to the connection's set-up commands, then sends ``script`` once
    the batch's ``STRLEN`` arrives (and, with ``trickle``, 16 bytes of it every 0.5 s).
    Counts connections and notices when the client closes one."""

    def __init__(self, script: bytes, trickle: bool = False) -> None:
        self.script = script
        self.trickle = trickle
        self.connections = 0
        self.closed_by_client = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(10)
        buf = b""
        try:
            while not self._stop.is_set():
                data = c.recv(65536)
                if not data:
                    self.closed_by_client += 1
                    return
                buf += data
                if b"STRLEN" in buf:
                    if self.trickle:
                        for i in range(0, len(self.script), 16):
                            c.sendall(self.script[i : i + 16])
                            time.sleep(0.5)
                    else:
                        c.sendall(self.script)
                    buf = b""
                    continue
                if buf.endswith(b"\r\n"):
                    c.sendall(_setup_replies(buf))
                    buf = b""
        except OSError:
            return
        finally:
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.fixture
def fake() -> Iterator[type[FakeServer]]:
    made: list[FakeServer] = []

    class Made(FakeServer):
        def __init__(self, script: bytes, trickle: bool = False) -> None:
            super().__init__(script, trickle)
            made.append(self)

    yield Made
    for s in made:
        s.close()


BAD_REPLIES = {
    "value longer than asked": (b":10\r\n$10\r\n0123456789\r\n", InvalidResponse),
    "huge length": (b":10\r\n$1152921504606846976\r\n", InvalidResponse),
    "malformed length": (b":10\r\n$12x\r\n", InvalidResponse),
    "endless line": (b":" + b"9" * 200_000, InvalidResponse),
    "unknown reply type": (b"*1\r\n", InvalidResponse),
    "value not followed by CRLF": (b":4\r\n$4\r\nabcdXY", InvalidResponse),
    "bytes after the last reply": (b":4\r\n$4\r\nabcd\r\n:1\r\n", InvalidResponse),
}


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_replies_no_server_sends_are_errors_and_drop_the_connection(fake: type[FakeServer], case: str) -> None:
    script, error = BAD_REPLIES[case]
    srv = fake(script)
    pool = _pool(srv.port)
    try:
        t0 = time.monotonic()
        with pytest.raises(error):
            read_ranges(pool, [b"k"], [8])
        assert time.monotonic() - t0 < 5
        deadline = time.monotonic() + 5
        while srv.closed_by_client < srv.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.closed_by_client == srv.connections >= 1  # dropped, never back in the pool
    finally:
        pool.disconnect()


def test_cut_replies_close_the_server_connection(fake: type[FakeServer]) -> None:
    """A server that closes the connection mid-value: one more try on a fresh connection
    (a pooled connection can be stale), then the error."""

    class Closing(FakeServer):
        def _serve(self, c: socket.socket) -> None:
            try:
                c.settimeout(10)
                buf = b""
                while b"STRLEN" not in buf:
                    data = c.recv(65536)
                    if not data:
                        return
                    buf += data
                    if b"STRLEN" not in buf and buf.endswith(b"\r\n"):
                        c.sendall(_setup_replies(buf))
                        buf = b""
                c.sendall(b":100\r\n$8\r\nabc")
            finally:
                c.close()

    srv = Closing(b"")
    pool = _pool(srv.port)
    try:
        with pytest.raises(RedisConnectionError):
            read_ranges(pool, [b"k"], [8])
        assert srv.connections == 2  # the batch was sent once more on a fresh connection
    finally:
        pool.disconnect()
        srv.close()


def test_a_trickling_server_is_cut_at_the_call_deadline(fake: type[FakeServer]) -> None:
    srv = fake(b":100000\r\n$100000\r\n" + b"x" * 100_000 + b"\r\n", trickle=True)
    pool = _pool(srv.port)
    try:
        t0 = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            with call_deadline(1.0):
                read_ranges(pool, [b"k"], [200_000])
        assert time.monotonic() - t0 < 2.5
    finally:
        pool.disconnect()


def test_negative_control_the_fake_server_can_serve_a_valid_reply(fake: type[FakeServer]) -> None:
    srv = fake(b":4\r\n$4\r\nabcd\r\n")
    pool = _pool(srv.port)
    try:
        assert read_ranges(pool, [b"k"], [8]) == [4, bytearray(b"abcd")]
    finally:
        pool.disconnect()
