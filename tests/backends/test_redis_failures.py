"""Failure behaviour of the redis tier against real redis-server processes: a wrong
password is one clear error at startup; a server that is down at startup, killed
mid-run or frozen (SIGSTOP: a slow server) turns calls into misses in bounded time,
the health gate then answers without touching the network, and the tier recovers
when the server is back (data included, for a server with an append-only file)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, free_port, redis_binary  # noqa: E402

from lmcache_backend_redis import create_redis_backend  # noqa: E402
from lmcache_core.backend import BackendError  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

FAST = {"connect_timeout_s": 0.3, "socket_timeout_s": 0.5, "retries": 0, "down_cooldown_s": 0.5}


@pytest.fixture
def ctx() -> Any:
    redis_binary()
    return make_context(key_path="backends[1]")


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    return fn(), time.monotonic() - t0


def test_wrong_password_is_one_clear_error(ctx: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(password="right-pass-0123")
    try:
        (tmp_path / "pw").write_text("wrong-pass-4567\n")
        caplog.set_level(logging.DEBUG)
        with pytest.raises(BackendError) as err:
            create_redis_backend({"url": server.url, "password_file": str(tmp_path / "pw"), **FAST}, ctx)
        msg = str(err.value)
        assert "refused the credentials" in msg and "backends[1].password_file" in msg and server.url in msg
        assert "wrong-pass-4567" not in msg and "wrong-pass-4567" not in caplog.text
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []  # the error, not a log storm

        with pytest.raises(BackendError, match="refused the credentials"):  # no password at all
            create_redis_backend({"url": server.url, **FAST}, ctx)
        url = f"redis://:right-pass-0123@127.0.0.1:{server.port}/0"  # negative control: right password works
        b = create_redis_backend({"url": url, **FAST}, ctx)
        assert "right-pass-0123" not in repr(b) and "right-pass-0123" not in str(b.stats())
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert b.put(key, data) and b.get(key, torch.empty_like(data))
        b.close()
    finally:
        server.stop()


def test_server_down_at_startup_then_up(ctx: Any) -> None:
    port = free_port()
    b = create_redis_backend({"url": f"redis://127.0.0.1:{port}/0", **FAST}, ctx)  # not fatal: a cache
    server = None
    try:
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert b.stats().extra["server_down"] is True
        n, dt = _timed(lambda: b.contains([key]))
        assert n == 0 and dt < 0.1  # gated: no connect attempt
        assert b.put(key, data) is False
        server = RedisServer(port=port)
        time.sleep(FAST["down_cooldown_s"] + 0.1)
        assert b.put(key, data) and b.contains([key]) == 1
        assert b.stats().extra["server_down"] is False
    finally:
        b.close()
        if server is not None:
            server.stop()


def test_server_killed_and_restarted_mid_run(ctx: Any) -> None:
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always")
    b = create_redis_backend({"url": server.url, **FAST}, ctx)
    try:
        items = [(random_key(), random_chunk(shape=(32, 32), seed=i)) for i in range(8)]
        keys = [k for k, _ in items]
        assert b.put_many(items[:4]) == [True] * 4
        server.kill()
        n, dt = _timed(lambda: b.contains(keys))
        assert n == 0 and dt < 2.0
        assert b.get(keys[0], torch.empty(32, 32, dtype=torch.float16)) is False
        assert b.put_many(items[4:]) == [False] * 4
        calls, dt = _timed(lambda: [b.contains(keys) for _ in range(50)])
        assert calls == [0] * 50 and dt < 0.2  # the gate answers while the server is down
        s = b.stats()
        assert s.extra["server_down"] and s.extra["server_trips"] == 1 and s.errors >= 1 and s.skipped >= 4

        server.start()  # same port, same append-only file
        time.sleep(FAST["down_cooldown_s"] + 0.1)
        assert b.contains(keys) == 4  # what was stored before the crash is back
        assert b.put_many(items[4:]) == [True] * 4
        outs = [torch.empty(32, 32, dtype=torch.float16) for _ in items]
        assert b.get_many(keys, outs) == [True] * 8
        assert all(torch.equal(o, d) for o, (_, d) in zip(outs, items))
        assert b.stats().extra["server_down"] is False
    finally:
        b.close()
        server.stop()


def test_pooled_connection_survives_a_quick_restart(ctx: Any) -> None:
    server = RedisServer()
    b = create_redis_backend({"url": server.url, "check_exists_before_put": False, **FAST}, ctx)
    try:
        first, second = random_key(), random_key()
        assert b.put(first, random_chunk(shape=(8, 8)))  # leaves a pooled connection
        server.restart()  # that connection is now dead
        assert b.put(second, random_chunk(shape=(8, 8)))  # the SET pipeline is the first call
        assert b.contains([second]) == 1
        assert b.stats().extra["server_trips"] == 0
    finally:
        b.close()
        server.stop()


def test_slow_server_is_a_bounded_miss(ctx: Any) -> None:
    server = RedisServer()
    b = create_redis_backend({"url": server.url, **FAST}, ctx)
    try:
        key, data = random_key(), random_chunk(shape=(64, 64))
        assert b.put(key, data)
        server.pause()  # accepts nothing, answers nothing
        n, dt = _timed(lambda: b.contains([key]))
        assert n == 0 and dt < FAST["socket_timeout_s"] + 1.0
        ok, dt = _timed(lambda: b.get(key, torch.empty_like(data)))
        assert ok is False and dt < 0.1  # gated after the first timeout
        server.resume()
        time.sleep(FAST["down_cooldown_s"] + 0.1)
        out = torch.empty_like(data)
        assert b.contains([key]) == 1 and b.get(key, out) and torch.equal(out, data)
    finally:
        b.close()
        server.stop()


def test_remove_while_down_raises(ctx: Any) -> None:
    server = RedisServer()
    b = create_redis_backend({"url": server.url, **FAST}, ctx)
    try:
        key = random_key()
        assert b.put(key, random_chunk(shape=(8, 8)))
        server.kill()
        with pytest.raises(BackendError, match="redis remove"):
            b.remove(key)
    finally:
        b.close()
        server.stop()
