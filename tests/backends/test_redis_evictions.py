"""What a real redis-server evicts or expires reaches the engine's listeners (KV events).

Each test starts its own ``redis-server`` on loopback (the notification setting is
server-wide). Under ``maxmemory`` with ``allkeys-lru`` the tier must report exactly
the keys the server no longer has (asked with ``EXISTS``) and none it still holds;
keys with ``ttl_s`` are reported when they expire; names outside the tier's prefix,
or under it but not chunk keys, are ignored; a server that refuses ``CONFIG`` is
logged once and the tier goes on working. No listener: no subscription.
"""

from __future__ import annotations

import contextlib
import logging
import math
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
        assert len(refused) == 1 and "subscribing anyway" in refused[0].getMessage()
        # unreadable setting (CONFIG renamed away, as on managed services): subscribed anyway, and it says why
        assert tier.stats().extra["key_events"].startswith("subscribed (notify-keyspace-events not readable: CONFIG GET")
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


def test_forged_notifications_are_not_reported_and_real_ones_are() -> None:
    """20,000 forged 'evicted' messages naming chunks the server still holds, while
    10 real chunks expire (the rate bound raised out of the way): every real expiry is
    reported, no forged one (the server is asked with EXISTS); before round 2, every
    forged name was reported as dropped."""
    rec = Recorder()
    with contextlib.ExitStack() as stack:  # closed in reverse, whatever fails
        server = RedisServer()
        stack.callback(server.kill)
        tier = tier_on(server, rec, max_key_events_per_s=10**6)
        stack.callback(tier.close)
        expiring = create_redis_backend({"url": server.url, "prefix": PREFIX, "ttl_s": 1.0}, make_context())
        stack.callback(expiring.close)
        stop = threading.Event()
        stack.callback(stop.set)
        held = [random_key("held") for _ in range(50)]
        for k in held:
            assert tier.put(k, random_chunk((2, 8, 8)))
        names = [(PREFIX + k.to_str()).encode() for k in held]
        flooder = threading.Thread(target=lambda: _flood(server, names, 20_000, stop), daemon=True)
        t0 = time.monotonic()
        flooder.start()
        real = [random_key("real") for _ in range(10)]
        for k in real:
            assert expiring.put(k, random_chunk((2, 8, 8)))
        flooder.join(30)
        assert not flooder.is_alive()
        wait_until(lambda: set(rec) >= set(real), f"reported {len(set(rec) & set(real))} of 10 real expiries")
        wait_until(lambda: tier.stats().extra.get("key_events_present", 0) == 20_000, "forged names checked")
        assert set(rec) == set(real), f"forged names reported: {len(set(rec) - set(real))}"
        assert tier.stats().extra.get("key_event_pauses", 0) == 0
        print(f"20,000 forged notifications + 10 real expiries handled in {time.monotonic() - t0:.1f} s")


def _flood_of_gone_names(max_per_s: int | None, caplog: pytest.LogCaptureFixture) -> tuple[int, dict[str, Any], float]:
    """20,000 forged 'evicted' messages naming chunks never stored (so EXISTS finds them
    gone and each checked one becomes an evicted() call), published as fast as one
    client can; then one real chunk expires. Returns the evicted() calls for forged
    names, the tier's stats then, and the seconds from the flood's start to then."""
    rec = Recorder()
    caplog.set_level(logging.WARNING, logger="lmcache_backend_redis.backend")
    with contextlib.ExitStack() as stack:  # closed in reverse, whatever fails
        server = RedisServer()
        stack.callback(server.kill)
        tier = tier_on(server, rec, **({} if max_per_s is None else {"max_key_events_per_s": max_per_s}))
        stack.callback(tier.close)
        expiring = create_redis_backend({"url": server.url, "prefix": PREFIX, "ttl_s": 0.2}, make_context())
        stack.callback(expiring.close)
        stop = threading.Event()
        stack.callback(stop.set)
        names = [(PREFIX + random_key("gone").to_str()).encode() for _ in range(20_000)]
        t0 = time.monotonic()
        assert _flood(server, names, 20_000, stop) == 20_000
        took = time.monotonic() - t0
        wait_until(lambda: len(rec) >= 1000, "no forged name checked at all")  # the flood did reach the tier
        # what is still queued for the tier is handled (or dropped): until the count
        # stops growing for a second (a fixed 1.5 s was too short on a loaded machine)
        forged, deadline = -1, time.monotonic() + 60
        while len(rec) != forged and time.monotonic() < deadline:
            forged = len(rec)
            time.sleep(1.0)
        elapsed = time.monotonic() - t0
        # after the flood: a real expiry is still reported (the subscription is back)
        real = random_key("real")
        assert expiring.put(real, random_chunk((2, 8, 8)))
        wait_until(lambda: real in rec, "the real expiry after the flood was not reported")
        print(f"20,000 forged in {took:.2f} s: {forged} evicted() calls in {elapsed:.1f} s, {tier.stats().extra}")
        return forged, tier.stats().extra, elapsed


def test_a_flood_of_forged_notifications_costs_bounded_calls_and_cpu(caplog: pytest.LogCaptureFixture) -> None:
    """The attack: forged names of chunks the server does not hold pass the EXISTS
    check, so every one became an evicted() call (200,000 messages: 200,000 calls and
    5.5 s of CPU before round 3). With the default max_key_events_per_s (1,000) the
    watcher reads at most 1,000 a second and pauses the subscription for the rest of a
    second that brings more (the server discards what it holds for it): bounded calls
    and CPU, one warning, and a real expiry after the flood is still reported."""
    forged, extra, elapsed = _flood_of_gone_names(None, caplog)
    windows = math.ceil(elapsed) + 1  # one window of 1,000 a second at most
    assert 1000 <= forged <= 1000 * windows, f"{forged} evicted() calls for 20,000 forged names in {elapsed:.1f} s"
    assert extra["key_event_pauses"] >= 1
    assert extra["key_event_cpu_s"] < 0.5, extra["key_event_cpu_s"]  # the watcher's thread, EXISTS and calls included
    floods = [r for r in caplog.records if "key events in one second" in r.getMessage()]
    assert len(floods) == 1  # logged once a minute, not per pause


def test_flood_control_without_the_bound_every_forged_name_is_a_call(caplog: pytest.LogCaptureFixture) -> None:
    """Negative control for the test above: the same flood with the bound out of the
    way reaches the tier in full (so the bound, not a lost flood, is what limits it)."""
    forged, extra, _ = _flood_of_gone_names(10**7, caplog)
    assert forged == 20_000
    assert extra.get("key_event_pauses", 0) == 0


# -- the server's setting: read first, only missing flags added, never fought ---------------
def _subscribers(server: RedisServer) -> int:
    raw = server.client()
    try:
        return int(raw.pubsub_numsub("__keyevent@0__:evicted")[0][1])
    finally:
        raw.close()


def test_notifications_off_and_config_set_refused_means_no_subscription(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CONFIG GET allowed, CONFIG SET not, notify-keyspace-events empty: the server
    publishes no real evictions, so the tier subscribes to nothing (whatever came would
    be forged), says so once, works, and subscribes once the operator sets the flags
    (checked again every RECHECK_S, shortened here). Before: subscribed anyway."""
    from lmcache_backend_redis import events

    monkeypatch.setattr(events, "RECHECK_S", 0.5, raising=False)  # old code: none
    server = RedisServer()
    raw = server.client()
    tier = None
    try:
        raw.execute_command("ACL", "SETUSER", "noset", "reset", "on", ">noset-pass-1", "~*", "&*", "+@all", "-config|set")
        caplog.set_level(logging.WARNING, logger="lmcache_backend_redis.events")
        tier = create_redis_backend(
            {"url": server.url, "prefix": PREFIX, "username": "noset", "password": "noset-pass-1", "ttl_s": 0.3},
            make_context(key_path="backends[1]"),
        )
        rec = Recorder()
        tier.subscribe_evictions(rec)
        assert tier.watcher is not None
        wait_until(lambda: tier.stats().extra["key_events"].startswith("off:"), "not off")
        state = tier.stats().extra["key_events"]
        assert "CONFIG SET was refused" in state and "without 'Exe'" in state, state
        assert _subscribers(server) == 0
        assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""  # untouched
        k = random_key("off")
        assert tier.put(k, random_chunk((2, 8, 8))) and tier.contains([k]) == 1  # the tier works
        time.sleep(1.2)  # rechecked twice meanwhile: one warning only
        off = [r for r in caplog.records if "no key events from" in r.getMessage()]
        assert len(off) == 1 and "CONFIG SET was refused" in off[0].getMessage()
        # the operator turns them on: the next check subscribes and expiries are reported
        raw.config_set("notify-keyspace-events", "KEA")
        wait_until(lambda: tier.watcher is not None and tier.watcher.subscribed.is_set(), "never subscribed")
        assert tier.stats().extra["key_events"] == "subscribed"
        k2 = random_key("on")
        assert tier.put(k2, random_chunk((2, 8, 8)))
        wait_until(lambda: k2 in rec, "expiry not reported")
        assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] == "AKE"  # the operator's, as set
    finally:
        if tier is not None:
            tier.close()
        raw.close()
        server.kill()


def test_configure_keyspace_events_false_never_changes_the_server_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """configure_keyspace_events: false: the tier reads the setting and never sets it
    (no subscription while it lacks a flag), and with the operator's flags in place it
    reports expiries as usual. Control: the default adds the missing flags."""
    from lmcache_backend_redis import events

    monkeypatch.setattr(events, "RECHECK_S", 0.5, raising=False)  # old code: none
    server = RedisServer("--notify-keyspace-events", "Kg")
    raw = server.client()
    rec = Recorder()
    tier = None
    try:
        tier = tier_on(server, None, configure_keyspace_events=False, ttl_s=0.3)
        tier.subscribe_evictions(rec)
        wait_until(lambda: tier.stats().extra["key_events"].startswith("off:"), "not off")
        assert "configure_keyspace_events is false" in tier.stats().extra["key_events"]
        assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] == "gK"  # untouched
        assert _subscribers(server) == 0
        raw.config_set("notify-keyspace-events", "Exe")  # the operator's choice
        wait_until(lambda: tier.watcher is not None and tier.watcher.subscribed.is_set(), "never subscribed")
        k = random_key("op")
        assert tier.put(k, random_chunk((2, 8, 8)))
        wait_until(lambda: k in rec, "expiry not reported")
        assert raw.config_get("notify-keyspace-events")["notify-keyspace-events"] == "xeE"
        # control: the default adds only the missing flags, keeping the server's
        raw.config_set("notify-keyspace-events", "Kg")
        other = tier_on(server, Recorder())
        try:
            assert set(raw.config_get("notify-keyspace-events")["notify-keyspace-events"]) == set("KgExe")
        finally:
            other.close()
    finally:
        if tier is not None:
            tier.close()
        raw.close()
        server.kill()
