"""The redis tier on a real three-master Redis Cluster (cluster-enabled redis-server
processes on loopback): keys spread over all masters, a batch is one round trip per
node, a slot moved mid-run (``ASK`` while it migrates, ``MOVED`` after) still hits,
a master killed and restarted is a bounded miss, then recovers, and a master that dies
with a replica fails over: misses meanwhile, then every chunk hits on the new master."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
import torch
from redis.exceptions import AskError

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisCluster3, redis_cluster  # noqa: E402,F401 - fixtures
from test_redis_backend import SendCounter  # noqa: E402

from lmcache_backend_redis import RedisBackend, create_redis_backend  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

FAST = {"connect_timeout_s": 0.3, "socket_timeout_s": 1.0, "retries": 0, "down_cooldown_s": 0.5}


@pytest.fixture
def tier(redis_cluster: RedisCluster3, request: pytest.FixtureRequest) -> Iterator[RedisBackend]:
    b = create_redis_backend({"cluster": redis_cluster.seeds, "prefix": f"c:{request.node.name}:", **FAST}, make_context())
    yield b
    b.close()


def _items(n: int, shape: tuple[int, ...] = (32, 32)) -> list[tuple[Any, torch.Tensor]]:
    return [(random_key(), random_chunk(shape=shape, seed=i)) for i in range(n)]


def test_keys_spread_over_all_masters_and_batches_are_one_trip_per_node(
    tier: RedisBackend, redis_cluster: RedisCluster3, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = _items(48)
    keys = [k for k, _ in items]
    assert tier.contains(keys) == 0  # opens a connection to every node before counting
    count = SendCounter(monkeypatch)
    assert tier.put_many(items) == [True] * 48
    assert count.take() == 2 * 3  # EXISTS and SET pipelines, one send per master each
    per_node = redis_cluster.keys_per_node(tier.cfg.prefix)
    assert sum(per_node) == 48 and min(per_node) >= 5, per_node
    count.take()  # the raw clients above sent commands too
    assert tier.contains(keys) == 48
    assert count.take() == 3
    outs = [torch.empty(32, 32, dtype=torch.float16) for _ in items]
    assert tier.get_many(keys, outs) == [True] * 48
    assert count.take() == 3
    assert all(torch.equal(o, d) for o, (_, d) in zip(outs, items))


def _owner(cluster: RedisCluster3, slot: int) -> int:
    """Index in ``cluster.nodes`` of the master that serves ``slot``."""
    for entry in cluster.nodes[0].client().execute_command("CLUSTER", "SLOTS"):
        if int(entry[0]) <= slot <= int(entry[1]):
            port = int(entry[2][1])
            return next(i for i, n in enumerate(cluster.nodes) if n.port == port)
    raise AssertionError(f"slot {slot} has no owner")


def test_slot_migration_ask_then_moved(tier: RedisBackend, redis_cluster: RedisCluster3) -> None:
    items = _items(6)
    assert tier.put_many(items) == [True] * 6
    key, data = items[0]
    name = tier._name(key)
    c0 = redis_cluster.nodes[0].client()
    slot = int(c0.execute_command("CLUSTER", "KEYSLOT", name))
    src = _owner(redis_cluster, slot)
    dst = (src + 1) % 3
    ids = redis_cluster.node_ids()
    s_cli, d_cli = redis_cluster.nodes[src].client(), redis_cluster.nodes[dst].client()
    d_cli.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    s_cli.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    try:
        s_cli.execute_command("MIGRATE", "127.0.0.1", redis_cluster.nodes[dst].port, "", 0, 5000, "KEYS", name)
        with pytest.raises(AskError):  # the source now redirects the key's clients
            s_cli.exists(name)
        out = torch.empty_like(data)
        assert tier.contains([key]) == 1
        assert tier.get(key, out) and torch.equal(out, data)
    finally:
        for n in redis_cluster.nodes:
            n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
    out = torch.empty_like(data)
    assert tier.get(key, out) and torch.equal(out, data)  # the source answers MOVED now
    assert tier.contains([k for k, _ in items]) == 6
    fresh = _items(1)[0]
    assert tier.put(*fresh) and tier.contains([fresh[0]]) == 1
    assert tier.stats().errors == 0


def test_master_killed_and_restarted(redis_cluster: RedisCluster3) -> None:
    b = create_redis_backend({"cluster": redis_cluster.seeds, "prefix": "kill:", **FAST}, make_context())
    try:
        items = _items(24)
        keys = [k for k, _ in items]
        assert b.put_many(items) == [True] * 24
        victim = redis_cluster.nodes[2]
        victim.kill()
        t0 = time.monotonic()
        got = b.get_many(keys, [torch.empty(32, 32, dtype=torch.float16) for _ in keys])
        n = b.contains(keys)
        assert time.monotonic() - t0 < 5.0
        assert n == 0 and got == [False] * 24  # one pipeline: a node down fails the batch
        assert b.stats().extra["server_down"] is True
        victim.start()  # same port and nodes.conf: rejoins with its slots, empty
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # bounded: the cluster marks the node up again
            infos = [n.client().execute_command("CLUSTER", "INFO").decode() for n in redis_cluster.nodes]
            if all("cluster_state:ok" in i for i in infos):
                break
            time.sleep(0.1)
        time.sleep(FAST["down_cooldown_s"] + 0.1)
        assert victim.client().dbsize() == 0  # the restarted master came back empty
        c0 = redis_cluster.nodes[0].client()
        survivors = [k for k in keys if _owner(redis_cluster, int(c0.execute_command("CLUSTER", "KEYSLOT", b._name(k)))) != 2]
        assert 0 < len(survivors) < 24
        outs = [torch.empty(32, 32, dtype=torch.float16) for _ in survivors]
        assert b.get_many(survivors, outs) == [True] * len(survivors)
        assert b.put_many(items) == [True] * 24 and b.contains(keys) == 24
        assert b.stats().extra["server_down"] is False
    finally:
        b.close()


def test_failover_to_a_replica() -> None:
    cluster = RedisCluster3(replica=True, node_timeout_ms=1000)
    assert cluster.replica is not None
    seeds = [*cluster.seeds, cluster.replica.node]
    b = create_redis_backend({"cluster": seeds, "prefix": "fo:", **FAST}, make_context())
    try:
        items = _items(24)
        keys = [k for k, _ in items]
        assert b.put_many(items) == [True] * 24
        assert cluster.nodes[0].client().execute_command("WAIT", 1, 2000) == 1  # replicated
        on_first = cluster.keys_per_node("fo:")[0]
        assert on_first > 0
        cluster.nodes[0].kill()
        t0 = time.monotonic()
        assert b.contains(keys) == 0  # the dead master's slots fail the batch: a miss
        assert time.monotonic() - t0 < 3.0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # bounded: the replica is elected master
            role = cluster.replica.client().execute_command("ROLE")[0]
            info = cluster.replica.client().execute_command("CLUSTER", "INFO").decode()
            if role == b"master" and "cluster_state:ok" in info:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the replica was not promoted within 20 s")
        hit = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # bounded: cooldown, then the client learns the new map
            time.sleep(FAST["down_cooldown_s"] + 0.05)
            hit = b.contains(keys)
            if hit == 24:
                break
        assert hit == 24  # the promoted replica serves what the dead master held
        outs = [torch.empty(32, 32, dtype=torch.float16) for _ in keys]
        assert b.get_many(keys, outs) == [True] * 24
        assert all(torch.equal(o, d) for o, (_, d) in zip(outs, items))
        fresh = _items(4)
        assert b.put_many(fresh) == [True] * 4
        assert b.stats().extra["server_down"] is False
    finally:
        b.close()
        cluster.stop()


def test_cluster_unreachable_at_startup_then_up() -> None:
    from redis_server import free_port

    ports = [free_port(55535) for _ in range(3)]
    b = create_redis_backend({"cluster": [f"127.0.0.1:{p}" for p in ports], **FAST}, make_context())
    cluster = None
    try:
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert b.stats().extra["server_down"] is True  # not fatal: a cache
        assert b.contains([key]) == 0 and b.put(key, data) is False
        cluster = RedisCluster3(ports=ports)
        time.sleep(FAST["down_cooldown_s"] + 0.1)
        assert b.put(key, data) and b.contains([key]) == 1
        out = torch.empty_like(data)
        assert b.get(key, out) and torch.equal(out, data)
    finally:
        b.close()
        if cluster is not None:
            cluster.stop()


def test_cluster_wrong_password_is_one_clear_error(redis_cluster: RedisCluster3) -> None:
    from lmcache_core.backend import BackendError

    for n in redis_cluster.nodes:
        n.client().config_set("requirepass", "cluster-pass-1")
    try:
        with pytest.raises(BackendError, match="refused the credentials") as err:
            create_redis_backend(
                {"cluster": redis_cluster.seeds, "password": "nope-2", **FAST}, make_context(key_path="backends[2]")
            )
        assert "backends[2].password_file" in str(err.value) and "nope-2" not in str(err.value)
        ok = create_redis_backend({"cluster": redis_cluster.seeds, "password": "cluster-pass-1", **FAST}, make_context())
        assert ok.put(random_key(), random_chunk(shape=(8, 8)))
        ok.close()
    finally:
        for n in redis_cluster.nodes:
            redis.Redis(port=n.port, password="cluster-pass-1").config_set("requirepass", "")
