"""A hard per-tenant byte quota on the redis tier (``tenant_quota``), against real
``redis-server`` processes on loopback, no mocks.

Measured here: two writers of tenant ``flood`` (two tier instances, two connection
pools, as two engines would be) write 10x flood's quota while ``calm``'s chunks sit
on the same server, which runs with a small ``maxmemory`` under ``allkeys-lru``. At
every sample (the bytes of flood's values and its ledger's count, read in one Lua
snapshot, so both at one instant) flood holds at most its quota; calm's chunks all
read back byte for byte, its bytes do not move, and the server evicts nothing.
Negative control: the same flood without the quota makes the server evict most of
calm's chunks, so a quota that did nothing would fail the test.

Edge cases: a chunk larger than the quota is refused and counted; an overwrite does
not count twice; ``remove`` and ``erase`` (also from a config without the quota) drop
ledger entries, and no ledger key is taken for a chunk or a namespace record; a
flushed script cache (``NOSCRIPT``) is reloaded; ``ttl_s`` prunes expired entries;
chunks deleted to make room are the tenant's oldest and reach the eviction listener;
config errors (no tenant label, also on a cluster; a zero quota) name the key. The
cluster's quota: ``test_redis_cluster_tenant_quotas.py``."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
import torch

sys.path.insert(0, str(Path(__file__).parent))
import tenant_flood  # noqa: E402
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixtures

from lmcache_backend_redis import RedisBackend, create_redis_backend  # noqa: E402
from lmcache_core.backend import BackendContext, EraseMatch  # noqa: E402
from lmcache_core.config import ConfigError, CoreConfig  # noqa: E402
from lmcache_core.keys import ChunkKey, KeyNamespace  # noqa: E402
from lmcache_core.testing import make_context  # noqa: E402

CHUNK = 32 << 10  # payload bytes per chunk
QUOTA = 1 << 20  # flood's quota: about 31 chunks
CALM_CHUNKS = 16
HEADROOM = 4 << 20  # the server's maxmemory above what it uses empty
SAMPLES_MAX = 5000
FLOOD_DEADLINE_S = 60.0

SNAPSHOT = """
local real = 0
for _, k in ipairs(redis.call('KEYS', ARGV[1])) do real = real + redis.call('STRLEN', k) end
return {real, tonumber(redis.call('GET', ARGV[2]) or '0')}
"""
"""One tenant's bytes at one instant: the sum of its values' lengths (found by name)
and its ledger's count."""


def _ctx(tenant: str | None) -> BackendContext:
    return dataclasses.replace(make_context(key_path="backends[1]"), config=CoreConfig(tenant=tenant))


def _tier(server: RedisServer, prefix: str, tenant: str | None, quota: int | None, **extra: Any) -> RedisBackend:
    section: dict[str, Any] = {"url": server.url, "prefix": prefix, "eviction_events": False, **extra}
    if quota is not None:
        section["tenant_quota"] = quota
    return create_redis_backend(section, _ctx(tenant))


def _ns(tenant: str) -> KeyNamespace:
    return KeyNamespace(model="m", layout="t", dtype="u8", salt=f"{tenant}-salt")


def _chunk(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _key(tenant: str, i: int) -> ChunkKey:
    return _ns(tenant).key(i.to_bytes(16, "little"))


def _snapshot(client: redis.Redis, prefix: str, tenant: str) -> tuple[int, int]:
    """(bytes of ``tenant``'s values, its ledger's count), read atomically."""
    names = f"{prefix}v1-{_ns(tenant).id.hex()}-*"
    real, ledger = client.eval(SNAPSHOT, 0, names, f"{prefix}lmcache-quota-{tenant}:bytes")
    return int(real), int(ledger)


def _hits(tier: RedisBackend, tenant: str, n: int) -> int:
    out = torch.empty(CHUNK, dtype=torch.uint8)
    return sum(tier.get(_key(tenant, i), out) and torch.equal(out, _chunk(i)) for i in range(n))


@pytest.fixture
def lru_server() -> Iterator[RedisServer]:
    """A fresh server whose memory limit is HEADROOM above what it uses empty,
    evicting any key (``allkeys-lru``): what a server without per-tenant quotas does."""
    server = RedisServer("--maxmemory-policy", "allkeys-lru")
    try:
        client = server.client()
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + HEADROOM)
        yield server
    finally:
        server.stop()


def _flood(server: RedisServer, prefix: str, quota: int | None) -> tuple[list[RedisBackend], list[tuple[int, int]]]:
    """Two writers of tenant ``flood`` (two tier instances, as two engines) write 10x
    QUOTA between them while flood's bytes are sampled: the writers and the samples."""
    writers = [_tier(server, prefix, "flood", quota) for _ in range(2)]
    client = server.client()
    samples = tenant_flood.flood(
        writers,
        lambda w, i: w.put(_key("flood", i), _chunk(i)),
        10 * QUOTA // CHUNK,
        lambda: _snapshot(client, prefix, "flood"),
        deadline_s=FLOOD_DEADLINE_S,
        samples_max=SAMPLES_MAX,
    )
    return writers, samples


def _calm(server: RedisServer, prefix: str) -> RedisBackend:
    calm = _tier(server, prefix, "calm", QUOTA)
    for i in range(CALM_CHUNKS):
        assert calm.put(_key("calm", i), _chunk(i))
    return calm


def test_a_tenant_writing_10x_its_quota_moves_no_other_tenant(lru_server: RedisServer) -> None:
    prefix = "q:"
    calm = _calm(lru_server, prefix)
    client = lru_server.client()
    try:
        before = _snapshot(client, prefix, "calm")
        assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS
        writers, samples = _flood(lru_server, prefix, QUOTA)
        peak_real = max(real for real, _ in samples)
        peak_ledger = max(ledger for _, ledger in samples)
        print(f"\nquota flood: {len(samples)} samples, flood's peak {peak_real} bytes (ledger {peak_ledger}), quota {QUOTA}")
        assert len(samples) >= 20, len(samples)
        assert all(real <= ledger <= QUOTA for real, ledger in samples), samples
        assert samples[-1][0] > QUOTA // 2  # flood did fill its share
        evictions = sum(w.stats().extra["quota_evictions"] for w in writers)
        assert evictions > 200 and sum(w.stats().extra["quota_refused"] for w in writers) == 0
        assert writers[0].quota_usage() == samples[-1][1]
        for w in writers:
            w.close()
        assert _snapshot(client, prefix, "calm") == before  # calm's bytes: unmoved
        assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS  # calm's hit rate: unmoved, byte for byte
        assert client.info("stats")["evicted_keys"] == 0  # the quota bounded flood, not the server
    finally:
        calm.close()


def test_negative_control_without_the_quota_the_flood_evicts_the_other_tenant(lru_server: RedisServer) -> None:
    prefix = "q:"
    calm = _calm(lru_server, prefix)
    try:
        for w in _flood(lru_server, prefix, None)[0]:
            w.close()
        hits = _hits(calm, "calm", CALM_CHUNKS)
        evicted = lru_server.client().info("stats")["evicted_keys"]
        print(f"\nno quota: calm hits {hits}/{CALM_CHUNKS}, server evicted {evicted} keys")
        assert hits < CALM_CHUNKS // 2, hits
    finally:
        calm.close()


# -- edge cases -------------------------------------------------------------------------------------


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"tq:{request.node.name}:"


def _ledger(client: redis.Redis, prefix: str, tenant: str) -> tuple[int, int, int]:
    """(entries in order, entries in sizes, counted bytes) of ``tenant``'s ledger."""
    base = f"{prefix}lmcache-quota-{tenant}:"
    return int(client.zcard(base + "order")), int(client.hlen(base + "sizes")), int(client.get(base + "bytes") or 0)


def _frame_len(tier: RedisBackend, key: ChunkKey) -> int:
    return int(tier.client.strlen(f"{tier.cfg.prefix}{key}"))


def test_a_chunk_larger_than_the_quota_is_refused_and_counted(redis_server: RedisServer, prefix: str) -> None:
    tier = _tier(redis_server, prefix, "small", CHUNK // 2)
    try:
        assert not tier.put(_key("small", 1), _chunk(1))
        s = tier.stats()
        assert s.extra["quota_refused"] == 1 and s.skipped == 1 and s.puts == 0
        assert s.bytes_capacity == CHUNK // 2 and s.bytes_used == 0 and s.extra["quota_tenant"] == "small"
        assert redis_server.client().keys(prefix + "*") == []  # nothing stored, no ledger either
    finally:
        tier.close()


def test_an_overwrite_does_not_grow_the_usage(redis_server: RedisServer, prefix: str) -> None:
    tier = _tier(redis_server, prefix, "ow", QUOTA, check_exists_before_put=False)
    try:
        for _ in range(5):
            assert tier.put(_key("ow", 1), _chunk(1))
        size = _frame_len(tier, _key("ow", 1))
        assert tier.quota_usage() == size == tier.stats().bytes_used
        assert _ledger(redis_server.client(), prefix, "ow") == (1, 1, size)
    finally:
        tier.close()


def test_remove_and_erase_shrink_the_ledger_and_skip_its_keys(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    tier = _tier(redis_server, prefix, "er", QUOTA)
    admin = _tier(redis_server, prefix, None, None)  # an erase config without the quota
    try:
        for i in range(4):
            assert tier.put(_key("er", i), _chunk(i))
        size = _frame_len(tier, _key("er", 0))
        tier.record_namespace(_ns("er").id, b'{"tenant":"er"}')
        assert tier.remove(_key("er", 0))
        assert _ledger(client, prefix, "er") == (3, 3, 3 * size) and tier.quota_usage() == 3 * size
        assert admin.erase(EraseMatch(), dry_run=True) == 3  # chunks only: no ledger key, no record
        assert admin.erase(EraseMatch(frozenset({_ns("er").id}))) == 3
        assert _ledger(client, prefix, "er") == (0, 0, 0)
        assert admin.namespace_records() == {_ns("er").id: b'{"tenant":"er"}'}
    finally:
        tier.close()
        admin.close()


def test_a_flushed_script_cache_costs_nothing(redis_server: RedisServer, prefix: str) -> None:
    """The put sends the script's text (``EVAL``), so ``SCRIPT FLUSH`` (or a restart)
    never leaves a ``SET`` without its ledger entry."""
    tier = _tier(redis_server, prefix, "ns", QUOTA)
    try:
        assert tier.put(_key("ns", 1), _chunk(1))
        redis_server.client().script_flush()
        assert tier.put_many([(_key("ns", 2), _chunk(2)), (_key("ns", 3), _chunk(3))]) == [True, True]
        assert tier.quota_usage() == 3 * _frame_len(tier, _key("ns", 1))
        assert _ledger(redis_server.client(), prefix, "ns")[:2] == (3, 3)
        assert _hits(tier, "ns", 4) == 3  # chunks 1..3 (0 was never stored)
    finally:
        tier.close()


def test_the_oldest_chunks_make_room_and_are_reported_as_evicted(redis_server: RedisServer, prefix: str) -> None:
    probe = _tier(redis_server, prefix + "probe:", "probe", QUOTA)
    assert probe.put(_key("fifo", 0), _chunk(0))
    size = _frame_len(probe, _key("fifo", 0))
    probe.close()
    tier = _tier(redis_server, prefix, "fifo", 4 * size)
    seen: list[ChunkKey] = []
    tier.subscribe_evictions(seen.append)
    try:
        assert tier.put_many([(_key("fifo", i), _chunk(i)) for i in range(6)]) == [True] * 6
        assert seen == [_key("fifo", 0), _key("fifo", 1)]
        assert tier.stats().extra["quota_evictions"] == tier.stats().evictions == 2  # in tier_evictions too
        assert tier.stats().bytes_used == 4 * size
        assert tier.contains([_key("fifo", i) for i in range(2, 6)]) == 4 and tier.contains([_key("fifo", 0)]) == 0
    finally:
        tier.close()


@pytest.mark.parametrize("lost", [("bytes",), ("order",), ("sizes",), ("bytes", "order"), ("bytes", "sizes")])
def test_a_ledger_part_the_server_evicted_is_rebuilt_from_the_others(redis_server: RedisServer, lost: tuple[str, ...]) -> None:
    """Under an allkeys-* policy the server may evict the ledger's own keys (the tenant
    still reads its chunks, but writes nothing for a while). With a part gone, the
    quota was exceeded (the sum or the order lost: old chunks uncounted) or every
    chunk deleted for one put (the sizes lost: nothing ever subtracted). Here each
    part, and each pair that leaves one, is deleted as the server would, then the
    tenant writes on: its bytes stay within the quota, the ledger counts them
    exactly, and only as many old chunks go as the new ones need."""
    prefix = f"tq:rebuild-{'-'.join(lost)}:"  # (no glob characters: _snapshot matches by pattern)
    client = redis_server.client()
    tier = _tier(redis_server, prefix, "ev", QUOTA)
    try:
        assert tier.put(_key("ev", 0), _chunk(0))
        size, n = _frame_len(tier, _key("ev", 0)), QUOTA // _frame_len(tier, _key("ev", 0))  # what fits: 31
        assert tier.put_many([(_key("ev", i), _chunk(i)) for i in range(1, n)]) == [True] * (n - 1)
        old = n
        assert tier.stats().extra["quota_evictions"] == 0 and _snapshot(client, prefix, "ev") == (n * size, n * size)
        base = f"{prefix}lmcache-quota-ev:"
        client.delete(*(base + part for part in lost))
        new = 10
        assert tier.put_many([(_key("ev", 1000 + i), _chunk(1000 + i)) for i in range(new)]) == [True] * new
        real, counted = _snapshot(client, prefix, "ev")
        assert real <= QUOTA and counted == real, (real, counted)
        survivors = sum(tier.contains([_key("ev", i)]) for i in range(old))
        assert survivors == old - new and real == (survivors + new) * size
        assert _ledger(client, prefix, "ev")[:2] == (survivors + new, survivors + new)
    finally:
        tier.close()


def test_ttl_prunes_expired_entries_and_expires_the_ledger(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    tier = _tier(redis_server, prefix, "ttl", QUOTA, ttl_s=0.3)
    try:
        for i in range(3):
            assert tier.put(_key("ttl", i), _chunk(i))
        time.sleep(0.5)  # the three have expired
        assert tier.put(_key("ttl", 3), _chunk(3))
        size = _frame_len(tier, _key("ttl", 3))
        assert _ledger(client, prefix, "ttl") == (1, 1, size)
        assert 0 < client.pttl(f"{prefix}lmcache-quota-ttl:order") <= 300
    finally:
        tier.close()


def test_a_full_server_refuses_the_whole_put_and_the_ledger_stays_true() -> None:
    """Under ``noeviction`` a full server answers ``OOM`` when the transaction's
    commands are queued: nothing of the put runs (no entry without its chunk), and
    the put is a skipped one (``oom``), as without a quota."""
    server = RedisServer("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    tier = _tier(server, "full:", "full", 1 << 30)
    try:
        big = [torch.full((256 << 10,), i, dtype=torch.uint8) for i in range(16)]  # 4 MiB in all
        stored = [tier.put(_key("full", i), chunk) for i, chunk in enumerate(big)]
        s = tier.stats()
        assert stored[0] and not all(stored) and s.extra["oom"] == stored.count(False) == s.skipped
        real, ledger = _snapshot(server.client(), "full:", "full")
        assert real == ledger == tier.quota_usage() > 0
    finally:
        tier.close()
        server.stop()


@pytest.mark.parametrize(
    "section, tenant, fragment",
    [
        ({"url": "redis://127.0.0.1:1/0", "tenant_quota": "1GiB"}, None, "backends[1].tenant_quota: a quota is per tenant"),
        ({"cluster": ["127.0.0.1:7000"], "tenant_quota": "1GiB"}, None, "backends[1].tenant_quota: a quota is per tenant"),
        ({"url": "redis://127.0.0.1:1/0", "tenant_quota": 0}, "a", "tenant_quota must be a positive size"),
    ],
)
def test_quota_config_errors_name_the_key(section: dict[str, Any], tenant: str | None, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        create_redis_backend({"verify_on_start": False, **section}, _ctx(tenant))
    assert fragment in str(err.value)
