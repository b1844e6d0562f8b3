"""A hard per-tenant byte quota on a real three-master Redis Cluster (``tenant_quota``
with ``cluster``; :mod:`lmcache_backend_redis.cluster_quota`), no mocks.

Measured here: two writers of tenant ``flood`` (two tier instances, two cluster
clients, as two engines would be) write 10x flood's quota while ``calm``'s chunks sit
on the same cluster, whose masters run with a small ``maxmemory`` under
``allkeys-lru``. A sample is taken with every master's writes paused (``CLIENT PAUSE
... WRITE`` on all three, then the reads, then ``CLIENT UNPAUSE``), so the bytes of
flood's values on the three masters and its ledger's count are of one instant. At every
sample flood holds at most its quota; calm's chunks all read back byte for byte, its
bytes do not move, and no master evicts anything. Negative control: the same flood
without the quota makes the masters evict most of calm's chunks.

Also: an overwrite does not count twice; ``remove`` and ``erase`` drop ledger entries;
a writer that died between its reservation and its deletions leaves entries that lapse
and are finished by the next writer (the ledger then counts exactly what is stored);
the ledger's keys share one slot."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
import torch
from redis.crc import key_slot

sys.path.insert(0, str(Path(__file__).parent))
import tenant_flood  # noqa: E402
from redis_server import SLOTS, RedisCluster3, redis_cluster  # noqa: E402,F401 - fixtures

from test_redis_tenant_quotas import CALM_CHUNKS, CHUNK, QUOTA, _chunk, _ctx, _hits, _key, _ns  # noqa: E402

from lmcache_backend_redis import RedisBackend, create_redis_backend  # noqa: E402
from lmcache_backend_redis.cluster_quota import PARTS, Batch, ClusterLedger  # noqa: E402
from lmcache_core.backend import EraseMatch  # noqa: E402

HEADROOM = 2 << 20  # each master's maxmemory above what it uses empty (6 MiB in all)
SAMPLES_MAX = 2000
FLOOD_DEADLINE_S = 90.0
PAUSE_MS = 2000  # a sample's pause ends by itself after this, whatever happens to the test


@pytest.fixture
def fresh(redis_cluster: RedisCluster3) -> Iterator[RedisCluster3]:
    """The session's cluster, emptied, each master's memory limit HEADROOM above what it
    uses empty, evicting any key (``allkeys-lru``): what a cluster without per-tenant
    quotas does. Afterwards: emptied again, no limit (as the other tests expect it)."""
    clients = [node.client() for node in redis_cluster.nodes]
    try:
        for c in clients:
            c.flushall()
            c.config_resetstat()
            c.config_set("maxmemory-policy", "allkeys-lru")
            c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + HEADROOM)
        yield redis_cluster
    finally:
        for c in clients:
            c.config_set("maxmemory", 0)
            c.config_set("maxmemory-policy", "noeviction")
            c.flushall()


def _tier(cluster: RedisCluster3, prefix: str, tenant: str | None, quota: int | None, **extra: Any) -> RedisBackend:
    section: dict[str, Any] = {"cluster": cluster.seeds, "prefix": prefix, "eviction_events": False, **extra}
    if quota is not None:
        section["tenant_quota"] = quota
    return create_redis_backend(section, _ctx(tenant))


def _base(prefix: str, tenant: str) -> str:
    return f"{prefix}lmcache-quota-{{{tenant}}}:"


def _ledger_node(cluster: RedisCluster3, prefix: str, tenant: str) -> redis.Redis:
    """The master of the ledger's slot (RedisCluster3 gives master i the slots from
    i * SLOTS // 3 on)."""
    slot = key_slot((_base(prefix, tenant) + "bytes").encode())
    owner = max(i for i in range(3) if i * SLOTS // 3 <= slot)
    return cluster.nodes[owner].client()


def _snapshot(cluster: RedisCluster3, prefix: str, tenant: str) -> tuple[int, int]:
    """(bytes of ``tenant``'s values on all masters, its ledger's count) at one instant:
    every master's writes paused while both are read."""
    clients = [n.client() for n in cluster.nodes]
    pattern = f"{prefix}v1-{_ns(tenant).id.hex()}-*"
    ledger = _ledger_node(cluster, prefix, tenant)
    try:
        for c in clients:
            c.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        real = 0
        for c in clients:
            names = c.keys(pattern)
            if names:
                pipe = c.pipeline(transaction=False)
                for name in names:
                    pipe.strlen(name)
                real += sum(pipe.execute())
        counted = int(ledger.get(_base(prefix, tenant) + "bytes") or 0)
    finally:
        for c in clients:
            c.execute_command("CLIENT", "UNPAUSE")
    return real, counted


def _evicted(cluster: RedisCluster3) -> int:
    return sum(int(n.client().info("stats")["evicted_keys"]) for n in cluster.nodes)


def _flood(cluster: RedisCluster3, prefix: str, quota: int | None) -> tuple[list[RedisBackend], list[tuple[int, int]]]:
    """Two writers of tenant ``flood`` (two tier instances, two cluster clients, as two
    engines) write 10x QUOTA between them while flood's bytes are sampled."""
    writers = [_tier(cluster, prefix, "flood", quota, call_timeout_s=10) for _ in range(2)]
    samples = tenant_flood.flood(
        writers,
        lambda w, i: w.put(_key("flood", i), _chunk(i)),
        10 * QUOTA // CHUNK,
        lambda: _snapshot(cluster, prefix, "flood"),
        deadline_s=FLOOD_DEADLINE_S,
        samples_max=SAMPLES_MAX,
    )
    return writers, samples


def _calm(cluster: RedisCluster3, prefix: str) -> RedisBackend:
    calm = _tier(cluster, prefix, "calm", QUOTA)
    for i in range(CALM_CHUNKS):
        assert calm.put(_key("calm", i), _chunk(i))
    return calm


def test_a_tenant_writing_10x_its_quota_moves_no_other_tenant(fresh: RedisCluster3) -> None:
    prefix = "cq:"
    calm = _calm(fresh, prefix)
    try:
        before = _snapshot(fresh, prefix, "calm")
        assert before[0] == before[1] > 0
        assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS
        writers, samples = _flood(fresh, prefix, QUOTA)
        peak_real = max(real for real, _ in samples)
        peak_ledger = max(ledger for _, ledger in samples)
        print(
            f"\ncluster quota flood: {len(samples)} samples, flood's peak {peak_real} bytes (ledger {peak_ledger}), quota {QUOTA}"
        )
        assert len(samples) >= 20, len(samples)
        assert all(real <= ledger <= QUOTA for real, ledger in samples), samples
        assert samples[-1][0] > QUOTA // 2  # flood did fill its share
        stats = [w.stats() for w in writers]
        assert sum(s.extra["quota_evictions"] for s in stats) > 200
        assert sum(s.extra["quota_refused"] for s in stats) == 0 and sum(s.skipped for s in stats) == 0
        assert samples[-1][0] == samples[-1][1] == writers[0].quota_usage()  # settled: exact
        for w in writers:
            w.close()
        assert _snapshot(fresh, prefix, "calm") == before  # calm's bytes: unmoved
        assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS  # calm's hit rate: unmoved, byte for byte
        assert _evicted(fresh) == 0  # the quota bounded flood, not the masters
    finally:
        calm.close()


def test_negative_control_without_the_quota_the_flood_evicts_the_other_tenant(fresh: RedisCluster3) -> None:
    prefix = "cq:"
    calm = _calm(fresh, prefix)
    try:
        for w in _flood(fresh, prefix, None)[0]:
            w.close()
        hits = _hits(calm, "calm", CALM_CHUNKS)
        print(f"\ncluster, no quota: calm hits {hits}/{CALM_CHUNKS}, masters evicted {_evicted(fresh)} keys")
        assert hits < CALM_CHUNKS // 2, hits
    finally:
        calm.close()


# -- the ledger ----------------------------------------------------------------------------------------


def _ledger(cluster: RedisCluster3, prefix: str, tenant: str) -> dict[str, int]:
    """Entries per part of ``tenant``'s ledger and its counted bytes."""
    c, base = _ledger_node(cluster, prefix, tenant), _base(prefix, tenant)
    out = {
        "sizes": int(c.hlen(base + "sizes")),
        "order": int(c.zcard(base + "order")),
        "pending": int(c.zcard(base + "pending")),
        "gone": int(c.zcard(base + "gone")),
    }
    out["bytes"] = int(c.get(base + "bytes") or 0)
    return out


def test_the_ledger_is_one_slot_and_an_overwrite_does_not_count_twice(fresh: RedisCluster3) -> None:
    slots = {key_slot((_base("ow:", "ow") + p).encode()) for p in PARTS}
    assert len(slots) == 1
    tier = _tier(fresh, "ow:", "ow", QUOTA, check_exists_before_put=False)
    try:
        for _ in range(5):
            assert tier.put(_key("ow", 1), _chunk(1))
        real, counted = _snapshot(fresh, "ow:", "ow")
        assert real == counted == tier.quota_usage() == tier.stats().bytes_used > CHUNK
        assert _ledger(fresh, "ow:", "ow") == {"sizes": 1, "order": 1, "pending": 0, "gone": 0, "bytes": real}
    finally:
        tier.close()


def test_remove_and_erase_shrink_the_ledger(fresh: RedisCluster3) -> None:
    tier = _tier(fresh, "er:", "er", QUOTA)
    admin = _tier(fresh, "er:", None, None)  # an erase config without the quota
    try:
        for i in range(4):
            assert tier.put(_key("er", i), _chunk(i))
        size = _snapshot(fresh, "er:", "er")[0] // 4
        assert tier.remove(_key("er", 0))
        assert _ledger(fresh, "er:", "er") == {"sizes": 3, "order": 3, "pending": 0, "gone": 0, "bytes": 3 * size}
        assert admin.erase(EraseMatch(frozenset({_ns("er").id}))) == 3
        assert _ledger(fresh, "er:", "er") == {"sizes": 0, "order": 0, "pending": 0, "gone": 0, "bytes": 0}
        assert _snapshot(fresh, "er:", "er") == (0, 0)
    finally:
        tier.close()
        admin.close()


def test_a_writer_that_died_mid_put_is_finished_by_the_next_one(fresh: RedisCluster3) -> None:
    """A writer reserves a chunk and takes the tenant's oldest for deletion, then dies
    (no DEL, no SET, no confirmation). Until its entries lapse they stay counted (the
    quota holds with room to spare); after the lapse the next writer deletes what the
    dead one took, and the ledger counts exactly the bytes stored."""
    quota = 4 * (CHUNK + 1024)
    tier = _tier(fresh, "dd:", "dd", quota)
    assert isinstance(tier.ledger, ClusterLedger)
    tier.ledger = dataclasses.replace(tier.ledger, lease_ms=400)
    try:
        for i in range(4):
            assert tier.put(_key("dd", i), _chunk(i))
        real, counted = _snapshot(fresh, "dd:", "dd")
        assert real == counted and tier.stats().extra["quota_evictions"] == 0
        size = real // 4
        dead = tier.ledger.step(tier.client, Batch(), [(f"dd:{_key('dd', 90)}".encode(), size)])
        assert dead.answers == (0,) and len(dead.victims) == 1  # wait: the oldest taken for deletion
        again = tier.ledger.step(tier.client, Batch(), [(f"dd:{_key('dd', 91)}".encode(), size)])
        assert again.answers == (0,) and len(again.victims) == 1  # a second one, never granted into the first's room
        assert _ledger(fresh, "dd:", "dd")["gone"] == 2 and _snapshot(fresh, "dd:", "dd") == (4 * size, 4 * size)
        time.sleep(0.6)  # both "writers" died: their deletions lapse
        assert tier.put(_key("dd", 5), _chunk(5))
        real, counted = _snapshot(fresh, "dd:", "dd")
        assert real == counted <= quota and _ledger(fresh, "dd:", "dd")["gone"] == 0, _ledger(fresh, "dd:", "dd")
        out = torch.empty(CHUNK, dtype=torch.uint8)
        assert tier.get(_key("dd", 5), out) and torch.equal(out, _chunk(5))
        assert not tier.get(_key("dd", 0), out) and not tier.get(_key("dd", 1), out)  # the two taken: deleted
    finally:
        tier.close()


def test_a_chunk_another_writer_is_storing_is_skipped_not_refused(fresh: RedisCluster3) -> None:
    """The tenant's other engine has reserved a chunk and not yet confirmed it: this one
    skips it (counted in ``quota_in_flight``, not ``quota_refused``) and stores the rest."""
    tier = _tier(fresh, "fl:", "fl", QUOTA)
    assert isinstance(tier.ledger, ClusterLedger)
    try:
        other = tier.ledger.step(tier.client, Batch(), [(f"fl:{_key('fl', 1)}".encode(), CHUNK + 200)])
        assert other.answers == (1,)  # granted to the "other engine": pending
        assert tier.put_many([(_key("fl", 1), _chunk(1)), (_key("fl", 2), _chunk(2))]) == [False, True]
        s = tier.stats()
        assert s.extra["quota_in_flight"] == 1 and s.extra["quota_refused"] == 0 and s.skipped == 1
        assert _ledger(fresh, "fl:", "fl")["pending"] == 1  # the other engine's, until it confirms or lapses
    finally:
        tier.close()
