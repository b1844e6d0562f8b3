"""A hard per-tenant byte quota on the s3 tier (``tenant_quota``), against a real S3
endpoint on loopback (moto's ThreadedMotoServer), no mocks.

Measured here: two writers of tenant ``flood`` (two tier instances, as two engines,
each with two writing threads) write 10x flood's quota under flood's prefix while
``calm``'s chunks sit under calm's prefix in the same bucket. At every sample (the sum
of the sizes ListObjectsV2 gives for flood's chunks) flood holds at most its quota;
calm's chunks all read back byte for byte and its bytes do not move. Negative
controls: the same flood without the quota goes far past it (the sampling has teeth),
and a flood whose prefix calm shares deletes calm's chunks (the calm check has teeth,
and the per-tenant prefix rule is needed).

Edge cases: a chunk larger than the quota is refused and counted; an object already
there is not counted twice; leases come back on close; a crashed holder's lease holds
its bytes until it expires, then a reconcile reclaims it; ``remove`` and ``erase``
leave ``used`` overstating, never understating; the ledger is no chunk or record;
config errors name the key."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import MotoS3, s3_bucket, s3_server  # noqa: E402,F401 - fixtures

from lmcache_backend_s3 import S3Backend, create_s3_backend  # noqa: E402
from lmcache_backend_s3.config import S3Config  # noqa: E402
from lmcache_backend_s3.quota import LeaseTiming  # noqa: E402
from lmcache_core.backend import BackendContext, EraseMatch  # noqa: E402
from lmcache_core.config import ConfigError, CoreConfig  # noqa: E402
from lmcache_core.frames import FrameWriter  # noqa: E402
from lmcache_core.keys import ChunkKey, KeyNamespace  # noqa: E402
from lmcache_core.serde import RawCodec  # noqa: E402
from lmcache_core.testing import make_context  # noqa: E402

CHUNK = 64 << 10  # payload bytes per chunk
QUOTA = 1 << 20  # flood's quota: about 15 chunks
CALM_CHUNKS = 16
FLOOD_CHUNKS = 10 * QUOTA // CHUNK  # 10x the quota between the two writers
SAMPLES_MAX = 5000
FLOOD_DEADLINE_S = 60.0
LEDGER = "lmcache-quota"
LEASE_S = 4.0  # the crash test's lease: long enough for a loaded host to reach the refused put


def _ctx(tenant: str | None) -> BackendContext:
    return dataclasses.replace(make_context(key_path="backends[1]"), config=CoreConfig(tenant=tenant))


def _tier(server: MotoS3, bucket: str, prefix: str, tenant: str | None, quota: int | None, **extra: Any) -> S3Backend:
    section = server.options(bucket, prefix=prefix, **extra)
    if quota is not None:
        section["tenant_quota"] = quota
    return create_s3_backend(section, _ctx(tenant))


def _ns(tenant: str) -> KeyNamespace:
    return KeyNamespace(model="m", layout="t", dtype="u8", salt=f"{tenant}-salt")


def _chunk(seed: int, size: int = CHUNK) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _key(tenant: str, i: int) -> ChunkKey:
    return _ns(tenant).key(i.to_bytes(16, "little"))


FRAME = len(FrameWriter.encode(_key("x", 0), _chunk(0), RawCodec()))
"""Bytes of one chunk's object."""


def _chunk_bytes(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    """Every chunk object under ``prefix`` and its size (ListObjectsV2, all pages)."""
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/v1-"):
        out.update({o["Key"]: int(o["Size"]) for o in page.get("Contents", [])})
    return out


def _ledger(client: Any, bucket: str, prefix: str) -> dict[str, Any]:
    return dict(json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/{LEDGER}")["Body"].read()))


def _hits(tier: S3Backend, tenant: str, n: int) -> int:
    out = torch.empty(CHUNK, dtype=torch.uint8)
    return sum(tier.get(_key(tenant, i), out) and torch.equal(out, _chunk(i)) for i in range(n))


class Flood:
    """Two writers of tenant ``flood`` (two threads each) writing FLOOD_CHUNKS between
    them under ``prefix``, and a sampler of flood's chunk bytes running meanwhile
    (bounded in count and time)."""

    def __init__(self, server: MotoS3, bucket: str, prefix: str, quota: int | None, chunks: int = FLOOD_CHUNKS) -> None:
        self.server, self.bucket, self.prefix, self.quota, self.chunks = server, bucket, prefix, quota, chunks
        self.samples: list[int] = []
        self.evicted: list[ChunkKey] = []
        self.stats: list[Any] = []
        self.done = threading.Event()

    def _write(self, tier: S3Backend, keys: range) -> None:
        for i in keys:
            tier.put(_key("flood", i), _chunk(i))

    def _sample(self) -> None:
        client = self.server.client()
        while not self.done.is_set() and len(self.samples) < SAMPLES_MAX:
            self.samples.append(sum(_chunk_bytes(client, self.bucket, self.prefix).values()))

    def run(self) -> None:
        tiers = [
            _tier(self.server, self.bucket, self.prefix, "flood", self.quota, check_exists_before_put=False) for _ in range(2)
        ]
        for t in tiers:
            t.subscribe_evictions(self.evicted.append)
        sampler = threading.Thread(target=self._sample)
        sampler.start()
        quarter = self.chunks // 4
        writers = [
            threading.Thread(target=self._write, args=(tiers[w % 2], range(w * quarter, (w + 1) * quarter))) for w in range(4)
        ]
        try:
            for w in writers:
                w.start()
            for w in writers:
                w.join(FLOOD_DEADLINE_S)
            assert not any(w.is_alive() for w in writers), "the flood did not finish in time"
        finally:
            self.done.set()
            sampler.join(FLOOD_DEADLINE_S)
            self.stats = [t.stats() for t in tiers]
            for t in tiers:
                t.close()


@pytest.fixture
def calm(s3_server: MotoS3, s3_bucket: str) -> Iterator[S3Backend]:
    """Tenant calm's tier (its own prefix, and a quota that holds its CALM_CHUNKS chunks)."""
    tier = _tier(s3_server, s3_bucket, "lmcache/calm", "calm", 2 * QUOTA)
    for i in range(CALM_CHUNKS):
        assert tier.put(_key("calm", i), _chunk(i))
    yield tier
    tier.close()


def test_a_flood_of_10x_the_quota_stays_within_it_and_never_moves_another_tenant(
    s3_server: MotoS3, s3_bucket: str, calm: S3Backend
) -> None:
    client = s3_server.client()
    calm_before = _chunk_bytes(client, s3_bucket, "lmcache/calm")
    assert len(calm_before) == CALM_CHUNKS

    flood = Flood(s3_server, s3_bucket, "lmcache/flood", QUOTA)
    t0 = time.monotonic()
    flood.run()
    elapsed = time.monotonic() - t0

    assert len(flood.samples) >= 20, f"too few samples to judge: {len(flood.samples)}"
    peak = max(flood.samples)
    assert peak <= QUOTA, f"flood held {peak} bytes > quota {QUOTA} at some sample"
    assert all(s <= QUOTA for s in flood.samples)
    assert _chunk_bytes(client, s3_bucket, "lmcache/calm") == calm_before
    assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS
    evictions = sum(s.evictions for s in flood.stats)
    assert evictions > 0 and len(flood.evicted) == evictions
    assert all(k.namespace == _ns("flood").id for k in flood.evicted)
    after = sum(_chunk_bytes(client, s3_bucket, "lmcache/flood").values())
    used = _ledger(client, s3_bucket, "lmcache/flood")["used"]
    assert after <= used <= QUOTA
    print(
        f"\nflood: {FLOOD_CHUNKS} chunks of {FRAME} bytes in {elapsed:.1f}s, {len(flood.samples)} samples, "
        f"peak {peak} <= {QUOTA}; calm {CALM_CHUNKS}/{CALM_CHUNKS} hits, bytes unchanged; "
        f"evictions {evictions}, lease ops {sum(s.extra['quota_lease_ops'] for s in flood.stats)}, "
        f"reconciles {sum(s.extra['quota_reconciles'] for s in flood.stats)}; used after {used}, real {after}"
    )


def test_control_without_the_quota_the_flood_goes_far_past_it(s3_server: MotoS3, s3_bucket: str) -> None:
    flood = Flood(s3_server, s3_bucket, "lmcache/flood", None)
    flood.run()
    assert max(flood.samples) > 5 * QUOTA  # the sampling sees a tenant over its quota
    print(f"\ncontrol, no quota: peak {max(flood.samples)} bytes, {len(flood.samples)} samples")


def test_control_a_prefix_shared_with_the_flood_loses_the_other_tenants_chunks(s3_server: MotoS3, s3_bucket: str) -> None:
    """Why each tenant needs a prefix of its own: the quota deletes the oldest chunks
    under its prefix, whosever they are."""
    shared = _tier(s3_server, s3_bucket, "lmcache/shared", "calm", None)
    try:
        for i in range(CALM_CHUNKS):
            assert shared.put(_key("calm", i), _chunk(i))
        Flood(s3_server, s3_bucket, "lmcache/shared", QUOTA, chunks=FLOOD_CHUNKS // 4).run()
        kept = _hits(shared, "calm", CALM_CHUNKS)
    finally:
        shared.close()
    assert kept < CALM_CHUNKS // 2
    print(f"\ncontrol, shared prefix: calm keeps {kept}/{CALM_CHUNKS}")


def test_a_chunk_larger_than_the_quota_is_refused_and_counted(s3_server: MotoS3, s3_bucket: str) -> None:
    tier = _tier(s3_server, s3_bucket, "t/a", "a", 2 * CHUNK)
    try:
        assert not tier.put(_key("a", 0), _chunk(0, 4 * CHUNK))
        s = tier.stats()
        assert s.skipped == 1 and s.extra["quota_refused"] == 1 and s.puts == 0
        assert s.bytes_capacity == 2 * CHUNK and s.extra["quota_tenant"] == "a"
    finally:
        tier.close()
    assert _chunk_bytes(s3_server.client(), s3_bucket, "t/a") == {}


def test_leases_come_back_on_close_and_an_existing_object_counts_once(s3_server: MotoS3, s3_bucket: str) -> None:
    client = s3_server.client()
    first = _tier(s3_server, s3_bucket, "t/a", "a", QUOTA, check_exists_before_put=False)
    for i in range(3):
        assert first.put(_key("a", i), _chunk(i))
    assert _ledger(client, s3_bucket, "t/a")["used"] > 3 * FRAME  # a lease holds more than it spent
    first.close()
    assert _ledger(client, s3_bucket, "t/a") == {"tenant": "a", "quota": QUOTA, "used": 3 * FRAME, "leases": {}}

    second = _tier(s3_server, s3_bucket, "t/a", "a", QUOTA, check_exists_before_put=False)
    assert second.put(_key("a", 1), _chunk(1))  # already there: If-None-Match refuses the PUT, no bytes spent
    assert second.put(_key("a", 3), _chunk(3))
    second.close()
    assert _ledger(client, s3_bucket, "t/a")["used"] == 4 * FRAME == sum(_chunk_bytes(client, s3_bucket, "t/a").values())


def _quick_tier(server: MotoS3, bucket: str, quota: int) -> S3Backend:
    """Tenant a's tier under ``t/a`` with leases of LEASE_S: short request bounds (a
    write window of 2s) and no clock skew, so a lease can expire within a test."""
    section = server.options(bucket, prefix="t/a", tenant_quota=quota, op_deadline_s=1.0, max_attempts=1)
    cfg = S3Config.model_validate({**section, "connect_timeout_s": 0.3, "read_timeout_s": 0.7})
    ctx = make_context()
    return S3Backend(cfg, codec=ctx.codec, codecs=ctx.codecs, tenant="a", quota_timing=LeaseTiming(LEASE_S, 0.0))


def test_a_crashed_holders_lease_holds_its_bytes_until_it_expires(s3_server: MotoS3, s3_bucket: str) -> None:
    client = s3_server.client()
    quota = 4 * FRAME + FRAME // 2  # one lease (4 chunks) takes nearly all of it
    crashed = _quick_tier(s3_server, s3_bucket, quota)
    assert crashed.put(_key("a", 0), _chunk(0))
    (lease,) = _ledger(client, s3_bucket, "t/a")["leases"]
    other = _quick_tier(s3_server, s3_bucket, quota)
    try:
        assert not other.put(_key("a", 1), _chunk(1))  # the live lease keeps its bytes
        assert other.stats().extra["quota_refused"] == 1
        time.sleep(LEASE_S + 0.2)  # crashed never comes back: its lease expires
        assert other.put(_key("a", 1), _chunk(1))
        ledger = _ledger(client, s3_bucket, "t/a")
        assert lease not in ledger["leases"]
        real = sum(_chunk_bytes(client, s3_bucket, "t/a").values())
        assert real <= ledger["used"] <= quota
        assert other.stats().evictions == 1  # crashed's chunk, the tenant's oldest, made room
    finally:
        other.close()
        crashed.close()  # its lease is gone from the ledger: nothing to give back
    assert _ledger(client, s3_bucket, "t/a")["used"] == FRAME == sum(_chunk_bytes(client, s3_bucket, "t/a").values())


def test_remove_and_erase_leave_used_overstating_and_the_ledger_in_place(s3_server: MotoS3, s3_bucket: str) -> None:
    client = s3_server.client()
    tier = _tier(s3_server, s3_bucket, "t/a", "a", 8 * FRAME)
    try:
        for i in range(6):
            assert tier.put(_key("a", i), _chunk(i))
        assert tier.remove(_key("a", 0))
        assert tier.erase(EraseMatch()) == 5
        assert _chunk_bytes(client, s3_bucket, "t/a") == {}
        assert _ledger(client, s3_bucket, "t/a")["used"] >= 6 * FRAME  # overstates, never understates
        assert tier.namespace_records() == {}  # the ledger is no record
        for i in range(10, 30):  # the quota's reconcile counts again from a listing
            assert tier.put(_key("a", i), _chunk(i))
            real = sum(_chunk_bytes(client, s3_bucket, "t/a").values())
            assert real <= _ledger(client, s3_bucket, "t/a")["used"] <= 8 * FRAME
        assert tier.stats().extra["quota_reconciles"] >= 1
    finally:
        tier.close()
    assert _ledger(client, s3_bucket, "t/a")["leases"] == {}


def test_the_ledger_stays_when_a_tier_without_the_quota_erases(s3_server: MotoS3, s3_bucket: str) -> None:
    client = s3_server.client()
    tier = _tier(s3_server, s3_bucket, "t/a", "a", QUOTA)
    assert tier.put(_key("a", 0), _chunk(0))
    tier.close()
    plain = _tier(s3_server, s3_bucket, "t/a", None, None)
    try:
        assert plain.erase(EraseMatch()) == 1
    finally:
        plain.close()
    assert _ledger(client, s3_bucket, "t/a")["used"] == FRAME


def test_config_errors_name_the_key(s3_server: MotoS3, s3_bucket: str) -> None:
    with pytest.raises(ConfigError, match=r"backends\[1\]\.tenant_quota: a quota is per tenant"):
        _tier(s3_server, s3_bucket, "t/a", None, QUOTA)
    with pytest.raises(ConfigError, match="tenant_quota"):
        _tier(s3_server, s3_bucket, "t/a", "a", 0)
    owner = _tier(s3_server, s3_bucket, "t/a", "a", QUOTA)
    assert owner.put(_key("a", 0), _chunk(0))
    owner.close()
    with pytest.raises(ConfigError, match=r"backends\[1\]\.prefix: .*tenant 'a''s ledger, not 'b''s"):
        _tier(s3_server, s3_bucket, "t/a", "b", QUOTA)
