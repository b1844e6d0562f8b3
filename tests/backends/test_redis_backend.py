"""The redis tier against a real redis-server on loopback: config errors name their key,
values are checksummed frames (tampered, truncated, foreign, oversized or wrong-type
values are misses, untampered ones hit), batches are one round trip, TTL and prefix
land on the server, OOM replies are skipped puts and too-large chunks are refused."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
import torch

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixtures

from lmcache_backend_redis import RedisBackend, create_redis_backend  # noqa: E402
from lmcache_core.backend import BackendError  # noqa: E402
from lmcache_core.config import ConfigError  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402


@pytest.fixture
def ctx() -> Any:
    return make_context(key_path="backends[1]")


@pytest.fixture
def tier(redis_server: RedisServer, ctx: Any, request: pytest.FixtureRequest) -> Iterator[RedisBackend]:
    b = create_redis_backend({"url": redis_server.url, "prefix": f"t:{request.node.name}:"}, ctx)
    yield b
    b.close()


class SendCounter:
    """Counts redis-py's socket writes of packed commands: one per round trip."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.calls = 0
        orig = redis.connection.AbstractConnection.send_packed_command

        def counted(conn: Any, command: Any, check_health: bool = True) -> Any:
            self.calls += 1
            return orig(conn, command, check_health)

        mp.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)

    def take(self) -> int:
        n, self.calls = self.calls, 0
        return n


# -- config ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, fragment",
    [
        ({"url": "redis://127.0.0.1:1/0", "cluster": ["127.0.0.1:7000"]}, "exactly one of url"),
        ({}, "exactly one of url"),
        ({"url": "http://127.0.0.1:6379"}, "backends[1].url"),
        ({"url": "redis://127.0.0.1:6379/x"}, "database number"),
        ({"cluster": ["127.0.0.1"]}, "backends[1].cluster[0]"),
        ({"url": "redis://127.0.0.1:1/0", "prefix": "{tag}:"}, "hash tag"),
        ({"url": "redis://127.0.0.1:1/0", "password": "a", "password_file": "/x"}, "at most one of password"),
        ({"url": "redis://127.0.0.1:1/0", "tls": True}, "rediss://"),
        ({"url": "redis://127.0.0.1:1/0", "max_value_size": "1GiB"}, "proto-max-bulk-len"),
        ({"url": "redis://127.0.0.1:1/0", "ttl_s": 0}, "backends[1].ttl_s"),
        ({"url": "redis://127.0.0.1:1/0", "bogus": 1}, "backends[1].bogus"),
        ({"url": "redis://127.0.0.1:1/0", "tls_ca_file": "/etc/hostname"}, "TLS is not enabled"),
    ],
)
def test_config_errors_name_the_key(ctx: Any, section: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        create_redis_backend({"verify_on_start": False, **section}, ctx)
    assert fragment in str(err.value)


def test_empty_password_file_is_a_config_error(ctx: Any, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("\n")
    with pytest.raises(ConfigError, match=r"backends\[1\].password_file: .* is empty"):
        create_redis_backend({"url": "redis://127.0.0.1:1/0", "password_file": str(tmp_path / "pw")}, ctx)


def test_prefix_and_ttl_land_on_the_server(redis_server: RedisServer, ctx: Any) -> None:
    b = create_redis_backend({"url": redis_server.url, "prefix": "ttl-test:", "ttl_s": 1.0}, ctx)
    try:
        key = random_key()
        assert b.put(key, random_chunk(shape=(8, 8)))
        raw = redis_server.client()
        assert raw.keys("ttl-test:*") == [f"ttl-test:{key.to_str()}".encode()]
        assert 0 < raw.pttl(f"ttl-test:{key.to_str()}") <= 1000
        assert b.contains([key]) == 1
        time.sleep(1.2)
        assert b.contains([key]) == 0  # expired on the server
    finally:
        b.close()


# -- frames: corrupt values are misses -------------------------------------------------
def _tamper_cases(raw: redis.Redis, name: str, other: str) -> dict[str, Any]:
    good = raw.get(name)
    assert good is not None
    flipped = bytearray(good)
    flipped[-5] ^= 0x01
    return {
        "payload bit flipped": lambda: raw.set(name, bytes(flipped)),
        "truncated": lambda: raw.set(name, good[: len(good) // 2]),
        "garbage": lambda: raw.set(name, b"\x00" * 100),
        "empty": lambda: raw.set(name, b""),
        "another key's frame": lambda: raw.set(name, raw.get(other)),
        "oversized": lambda: raw.set(name, good + b"\x00" * (1 << 20)),
        "a list, not a string": lambda: (raw.delete(name), raw.rpush(name, good)),
    }


def test_corrupt_values_are_misses(tier: RedisBackend, redis_server: RedisServer) -> None:
    raw = redis_server.client()
    data, other_data = random_chunk(shape=(64, 64)), random_chunk(shape=(64, 64))
    key, other = random_key(), random_key()
    assert tier.put(key, data) and tier.put(other, other_data)
    name, other_name = tier._name(key), tier._name(other)
    good = raw.get(name)
    out = torch.empty_like(data)
    assert tier.get(key, out) and torch.equal(out, data)  # negative control: untouched value hits
    for what, tamper in _tamper_cases(raw, name, other_name).items():
        tamper()
        out.zero_()
        corrupt_before = tier.stats().extra["corrupt"]
        assert tier.get(key, out) is False, what
        assert tier.get_many([key], [out]) == [False], what
        if what != "empty":
            assert tier.stats().extra["corrupt"] > corrupt_before, what
        raw.delete(name)
        raw.set(name, good)
        assert tier.get(key, out) and torch.equal(out, data), f"restored after {what}"
    assert tier.stats().errors == 0


def test_oversized_value_is_read_only_up_to_the_bound(tier: RedisBackend, redis_server: RedisServer) -> None:
    key, data = random_key(), random_chunk(shape=(16, 16))
    assert tier.put(key, data)
    raw = redis_server.client()
    raw.append(tier._name(key), b"\x00" * (8 << 20))  # 8 MiB tail behind a 512-byte chunk
    before = raw.info("stats")["total_net_output_bytes"]
    assert tier.get(key, torch.empty_like(data)) is False
    sent = raw.info("stats")["total_net_output_bytes"] - before
    assert sent < 1 << 20, f"server sent {sent} bytes for a 512-byte chunk"


def test_delete_corrupt_removes_the_value(redis_server: RedisServer, ctx: Any) -> None:
    b = create_redis_backend({"url": redis_server.url, "prefix": "delc:", "delete_corrupt": True}, ctx)
    try:
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert b.put(key, data)
        redis_server.client().set(b._name(key), b"not a frame")
        assert b.get(key, torch.empty_like(data)) is False
        assert redis_server.client().exists(b._name(key)) == 0
        assert b.put(key, data) and b.get(key, torch.empty_like(data))
    finally:
        b.close()


def test_wrong_shape_is_a_miss_but_not_corrupt(tier: RedisBackend) -> None:
    key, data = random_key(), random_chunk(shape=(8, 8))
    assert tier.put(key, data)
    assert tier.get(key, torch.empty(4, 8, dtype=torch.float16)) is False
    assert tier.stats().extra["corrupt"] == 0
    assert tier.get(key, torch.empty_like(data))


# -- batching --------------------------------------------------------------------------
def test_batches_are_one_round_trip(tier: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    items = [(random_key(), random_chunk(shape=(32, 32), seed=i)) for i in range(16)]
    keys = [k for k, _ in items]
    assert tier.contains(keys) == 0  # opens the connection before counting
    count = SendCounter(monkeypatch)
    assert tier.put_many(items) == [True] * 16
    assert count.take() == 2  # EXISTS pipeline, SET pipeline
    assert tier.contains(keys) == 16
    assert count.take() == 1
    outs = [torch.empty(32, 32, dtype=torch.float16) for _ in items]
    assert tier.get_many(keys, outs) == [True] * 16
    assert count.take() == 1
    assert all(torch.equal(o, d) for o, (_, d) in zip(outs, items))
    assert tier.put_many(items) == [True] * 16  # all present: no SET at all
    assert count.take() == 1


# -- server-side limits ----------------------------------------------------------------
def test_oom_replies_are_skipped_puts(ctx: Any) -> None:
    server = RedisServer("--maxmemory", "6mb", "--maxmemory-policy", "noeviction")
    b = create_redis_backend({"url": server.url}, ctx)
    try:
        items = [(random_key(), random_chunk(shape=(512, 1024), seed=i)) for i in range(8)]  # 1 MiB each
        stored = [b.put(k, d) for k, d in items]
        s = b.stats()
        assert not all(stored) and stored[0]
        assert s.extra["oom"] == stored.count(False) == s.skipped
        assert s.extra["server_down"] is False  # a full server is not a down server
        out = torch.empty_like(items[0][1])
        assert b.get(items[0][0], out) and torch.equal(out, items[0][1])
    finally:
        b.close()
        server.stop()


def test_chunks_over_max_value_size_are_refused(redis_server: RedisServer, ctx: Any) -> None:
    b = create_redis_backend({"url": redis_server.url, "prefix": "big:", "max_value_size": "64KiB"}, ctx)
    try:
        small, big = random_key(), random_key()
        assert b.put(small, random_chunk(shape=(64, 64)))
        assert b.put(big, random_chunk(shape=(256, 256))) is False  # 128 KiB payload
        assert b.put_many([(big, random_chunk(shape=(256, 256))), (random_key(), random_chunk(shape=(8, 8)))]) == [False, True]
        s = b.stats()
        assert s.extra["too_large"] == 2 and s.skipped == 2
        assert b.contains([big]) == 0 and b.contains([small]) == 1
    finally:
        b.close()


def test_acl_user_limited_to_the_prefix(redis_server: RedisServer, ctx: Any) -> None:
    raw = redis_server.client()
    raw.execute_command("ACL", "SETUSER", "lmc", "reset", "on", ">lmc-pass-1", "~acl:*", "+@all")
    try:
        ok = create_redis_backend({"url": redis_server.url, "username": "lmc", "password": "lmc-pass-1", "prefix": "acl:"}, ctx)
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert ok.put(key, data) and ok.get(key, torch.empty_like(data))
        ok.close()
        outside = create_redis_backend(
            {"url": redis_server.url, "username": "lmc", "password": "lmc-pass-1", "prefix": "other:"}, ctx
        )
        with pytest.raises(BackendError, match="NOPERM|No permissions|permission") as err:
            outside.put(key, data)
        assert "ACL user" in str(err.value) and "lmc-pass-1" not in str(err.value)
        outside.close()
    finally:
        raw.execute_command("ACL", "DELUSER", "lmc")
