"""What a real redis-server evicts or expires reaches the engine's listeners (KV events).

Each test starts its own ``redis-server`` on loopback (the notification setting is
server-wide). Under ``maxmemory`` with ``allkeys-lru`` the tier must report exactly
the keys the server no longer has (asked with ``EXISTS``) and none it still holds;
keys with ``ttl_s`` are reported when they expire; names outside the tier's prefix,
or under it but not chunk keys, are ignored; a server that refuses ``CONFIG`` is
logged once and the tier goes on working. No listener: no subscription.
"""

from __future__ import annotations

import logging
import threading
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisCluster3, RedisServer  # noqa: E402

from lmcache_backend_redis import RedisBackend, create_redis_backend  # noqa: E402
from lmcache_backend_redis.events import merged_flags  # noqa: E402
from lmcache_core import CacheEngine, KeyNamespace, load_config  # noqa: E402
from lmcache_core.engine import TierEvent  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402
from lmcache_core.testing.tokens import store_tokens, token_hashes  # noqa: E402

WAIT_S = 15.0
SHAPE = (4, 64, 128)  # 64 KiB of fp16
PREFIX = "lmc-ev:"


class Recorder(list[ChunkKey]):
    def __call__(self, key: ChunkKey) -> None:
        self.append(key)


def wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cond(), what


def tier_on(server: RedisServer, rec: Recorder | None, **extra: Any) -> RedisBackend:
    b = create_redis_backend({"url": server.url, "prefix": PREFIX, **extra}, make_context(key_path="backends[1]"))
    if rec is not None:
        b.subscribe_evictions(rec)
        assert b.watcher is not None
        assert b.watcher.subscribed.wait(WAIT_S), b.stats().extra.get("key_events")
    return b


@pytest.fixture
def lru_server() -> Iterator[RedisServer]:
    s = RedisServer("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    yield s
    s.kill()


def test_server_evictions_are_reported_exactly(lru_server: RedisServer) -> None:
    rec = Recorder()
    tier = tier_on(lru_server, rec)
    raw = lru_server.client()
    try:
        keys = [random_key("ev") for _ in range(120)]  # 7.5 MiB into a 4 MiB server
        for k in keys:
            tier.put(k, random_chunk(SHAPE))
        present = {k for k in keys if raw.exists(PREFIX + k.to_str())}
        gone = set(keys) - present
        assert gone and present  # the server evicted some and kept some
        wait_until(lambda: set(rec) == gone, f"reported {len(set(rec))} of {len(gone)} evictions")
        time.sleep(0.5)  # negative control: nothing still held is reported, nothing twice
        assert not set(rec) & present
        assert len(rec) == len(gone)
        assert tier.stats().extra["server_evicted"] == len(gone)
        assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] != ""
    finally:
        raw.close()
        tier.close()


def test_expiry_is_reported_and_foreign_names_are_ignored() -> None:
    server = RedisServer("--notify-keyspace-events", "Kg")  # another user's flags: kept, ours added
    rec = Recorder()
    tier = tier_on(server, rec, ttl_s=0.2)
    raw = server.client()
    try:
        flags = raw.config_get("notify-keyspace-events")["notify-keyspace-events"]
        assert set("Kg") <= set(flags) and set("Exe") <= set(flags)
        raw.set("other-app:" + random_key().to_str(), b"x", px=100)  # foreign prefix
        raw.set(PREFIX + "not-a-chunk-key", b"x", px=100)  # our prefix, not a chunk key
        keys = [random_key("ttl") for _ in range(3)]
        for k in keys:
            assert tier.put(k, random_chunk((2, 8, 8)))
        wait_until(lambda: set(rec) == set(keys), f"reported {rec!r}")
        wait_until(lambda: tier.stats().extra.get("foreign_key_events", 0) == 2, "foreign names seen")
        assert set(rec) == set(keys)
        assert tier.stats().extra["server_expired"] == 3
    finally:
        raw.close()
        tier.close()
        server.kill()


def test_a_server_that_refuses_config_is_logged_once_and_the_tier_works(caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer("--rename-command", "CONFIG", "", "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    rec = Recorder()
    caplog.set_level(logging.WARNING, logger="lmcache_backend_redis.events")
    tier = tier_on(server, rec)
    try:
        keys = [random_key("noconf") for _ in range(120)]
        for k in keys:
            tier.put(k, random_chunk(SHAPE))
        assert tier.contains([keys[-1]]) == 1  # the tier works
        time.sleep(0.5)
        assert rec == []  # notifications are off on this server: nothing to report, no crash
        refused = [r for r in caplog.records if "cannot turn on keyspace notifications" in r.getMessage()]
        assert len(refused) == 1
        assert tier.stats().extra["key_events"] == "subscribed"
    finally:
        tier.close()
        server.kill()


def test_no_listener_no_subscription(lru_server: RedisServer) -> None:
    tier = tier_on(lru_server, None)
    raw = lru_server.client()
    try:
        tier.put(random_key(), random_chunk((2, 8, 8)))
        assert tier.watcher is None
        assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""
        assert raw.pubsub_numsub("__keyevent@0__:evicted") == [(b"__keyevent@0__:evicted", 0)]
    finally:
        raw.close()
        tier.close()


def test_engine_listener_sees_redis_evictions(lru_server: RedisServer) -> None:
    """The chain the connector uses: CacheEngine.add_listener -> TierEvent('evicted', 'redis', key)."""
    cfg = load_config(
        overrides={
            "chunk_size": 64,
            "backends": [{"name": "local_cpu", "max_size": "64MiB"}, {"name": "redis", "url": lru_server.url, "prefix": PREFIX}],
        }
    )
    eng = CacheEngine(cfg, namespace=KeyNamespace(model="m"))
    events: list[TierEvent] = []
    eng.add_listener(events.append)
    raw = lru_server.client()
    try:
        tier = eng.tiers[1]
        assert isinstance(tier, RedisBackend) and tier.watcher is not None
        assert tier.watcher.subscribed.wait(WAIT_S)
        tokens = [i % 30000 for i in range(64 * 80)]
        data = [random_chunk(SHAPE, seed=i) for i in range(80)]
        assert store_tokens(eng, tokens, data) == 80
        assert eng.flush(60)
        keys = eng.keys(token_hashes(eng, tokens))
        gone = {k for k in keys if not raw.exists(PREFIX + k.to_str())}
        assert gone
        wait_until(lambda: {e.key for e in events if e.kind == "evicted" and e.tier == "redis"} == gone, "engine events")
    finally:
        raw.close()
        eng.close()


def test_merged_flags() -> None:
    assert merged_flags("") == "Exe"
    assert merged_flags("Kg") == "KgExe"
    assert merged_flags("AE") is None
    assert merged_flags("Ex") == "Exe"
    assert merged_flags("xeE") is None


def test_cluster_expiries_are_reported_from_every_primary() -> None:
    cluster = RedisCluster3()
    rec = Recorder()
    tier = create_redis_backend({"cluster": cluster.seeds, "prefix": PREFIX, "ttl_s": 2}, make_context())
    try:
        tier.subscribe_evictions(rec)
        assert tier.watcher is not None and tier.watcher.subscribed.wait(WAIT_S)
        keys = [random_key("cl") for _ in range(30)]
        for k in keys:
            assert tier.put(k, random_chunk((2, 8, 8)))
        assert all(n > 0 for n in cluster.keys_per_node(PREFIX))  # spread over the 3 masters
        wait_until(lambda: set(rec) == set(keys), f"reported {len(set(rec))} of {len(keys)}")
    finally:
        tier.close()
        cluster.stop()


def test_an_acl_user_without_subscribe_gets_no_events_and_a_working_tier(
    lru_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    raw = lru_server.client()
    raw.execute_command("ACL", "SETUSER", "nosub", "reset", "on", ">nosub-pass-1", "~*", "+@all", "-@pubsub", "-config")
    caplog.set_level(logging.WARNING, logger="lmcache_backend_redis.events")
    tier = create_redis_backend(
        {"url": lru_server.url, "prefix": PREFIX, "username": "nosub", "password": "nosub-pass-1", "down_cooldown_s": 0.2},
        make_context(key_path="backends[1]"),
    )
    try:
        rec = Recorder()
        tier.subscribe_evictions(rec)
        assert tier.watcher is not None
        wait_until(lambda: tier.watcher is not None and tier.watcher.reconnects >= 3, "retried")
        assert not tier.watcher.subscribed.is_set()
        assert "NOPERM" in tier.stats().extra["key_events"] or "permission" in tier.stats().extra["key_events"]
        keys = [random_key("acl") for _ in range(3)]
        assert all(tier.put(k, random_chunk((2, 8, 8))) for k in keys)
        assert tier.contains(keys) == 3  # the tier itself works
        warnings = [r for r in caplog.records if "no key-event subscription" in r.getMessage()]
        assert len(warnings) == 1  # the same reason is not repeated
        assert len([r for r in caplog.records if "cannot turn on keyspace notifications" in r.getMessage()]) == 1
    finally:
        tier.close()
        raw.close()


# -- forged and flooded notifications --------------------------------------------------------
def _flood(server: RedisServer, names: list[bytes], total: int, stop: threading.Event) -> int:
    """PUBLISH ``total`` forged 'evicted' notifications cycling through ``names``, in
    pipelines of 1,000 (any client may publish on the key-event channels)."""
    raw = server.client()
    sent = 0
    try:
        while sent < total and not stop.is_set():
            pipe = raw.pipeline(transaction=False)
            for i in range(sent, min(total, sent + 1000)):
                pipe.publish("__keyevent@0__:evicted", names[i % len(names)])
            pipe.execute()
            sent = min(total, sent + 1000)
    finally:
        raw.close()
    return sent


def test_forged_notifications_are_not_reported_and_real_ones_survive_a_flood() -> None:
    """200,000 forged 'evicted' messages naming chunks the server still holds, while
    10 real chunks expire: every real expiry is reported, no forged one (the server is
    asked with EXISTS); before, every forged name was reported as dropped."""
    server = RedisServer()
    rec = Recorder()
    tier = tier_on(server, rec)
    expiring = create_redis_backend({"url": server.url, "prefix": PREFIX, "ttl_s": 1.0}, make_context())
    stop = threading.Event()
    try:
        held = [random_key("held") for _ in range(50)]
        for k in held:
            assert tier.put(k, random_chunk((2, 8, 8)))
        names = [(PREFIX + k.to_str()).encode() for k in held]
        flooder = threading.Thread(target=lambda: _flood(server, names, 200_000, stop), daemon=True)
        t0 = time.monotonic()
        flooder.start()
        real = [random_key("real") for _ in range(10)]
        for k in real:
            assert expiring.put(k, random_chunk((2, 8, 8)))
        flooder.join(60)
        assert not flooder.is_alive()
        wait_until(lambda: set(rec) >= set(real), f"reported {len(set(rec) & set(real))} of 10 real expiries")

        def handled() -> int:
            x = tier.stats().extra
            return int(x.get("key_events_present", 0) + x.get("key_events_dropped", 0))

        deadline = time.monotonic() + 60
        while handled() < 200_000 and time.monotonic() < deadline:
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert handled() == 200_000, f"{handled()} of 200,000 forged messages handled after {took:.0f} s"
        assert set(rec) == set(real), f"forged names reported: {len(set(rec) - set(real))}"
        assert tier.stats().extra.get("key_events_dropped", 0) == 0, "the default rate should keep up with this flood"
        print(f"200,000 forged notifications + 10 real expiries handled in {took:.1f} s")
    finally:
        stop.set()
        expiring.close()
        tier.close()
        server.kill()


def test_a_flood_beyond_the_rate_is_dropped_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer()
    rec = Recorder()
    caplog.set_level(logging.WARNING, logger="lmcache_backend_redis.backend")
    tier = tier_on(server, rec, max_key_events_per_s=1000)
    stop = threading.Event()
    try:
        names = [(PREFIX + random_key("gone").to_str()).encode() for _ in range(100)]  # never stored: "gone"
        assert _flood(server, names, 20_000, stop) == 20_000
        wait_until(lambda: tier.stats().extra.get("key_events_dropped", 0) > 0, "nothing dropped")
        time.sleep(1.0)
        extra = tier.stats().extra
        checked = extra.get("server_evicted", 0) + extra.get("key_events_present", 0)
        # at most the burst plus the refill over the run: bounded work, not 20,000 checks
        assert checked <= 1000 + 1000 * 30, checked
        assert extra["key_events_dropped"] >= 20_000 - checked - 10
        floods = [r for r in caplog.records if "key events a second" in r.getMessage()]
        assert len(floods) == 1
    finally:
        stop.set()
        tier.close()
        server.kill()
