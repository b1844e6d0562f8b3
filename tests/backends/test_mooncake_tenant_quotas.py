"""A hard per-tenant byte quota on the mooncake tier (``tenant_quota``), against real
``mooncake_master`` and segment-owner processes on loopback, no mocks.

The quota is the master's own: started with ``--enable_multi_tenants`` and a tenant
quota policy, it gives each client tenant (the tier sets it to the engine's
``tenant`` label) its own namespace and admits a put only within the tenant's quota,
evicting the tenant's own objects to make room. Measured here: two writers of tenant
``flood`` (two tier instances, two clients, as two engines would be) write 10x
flood's quota into a pool that is smaller than the flood, while ``calm``'s chunks sit
in the same pool. At every sample (one read of the master's metrics: flood's charged
bytes, calm's, and the pool's allocated bytes) flood holds at most its quota by the
master's account, and by the allocator's at most one object more (the memory of an
object just evicted, freed right after); calm's bytes do not move, the master evicts
nothing pool-wide, and calm's chunks all read back byte for byte. Negative control:
the same flood on a master without tenant quotas evicts most of calm's chunks, so a
quota that did nothing would fail the test.

Edge cases: an engine without a tenant label, a master without tenant quotas, a
tenant the policy does not list, and a metrics server that does not answer are
startup errors naming the key; without ``verify_on_start`` an unlisted tenant's puts
are skipped and counted; an erase removes the tenant's own objects only."""

from __future__ import annotations

import dataclasses
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import tenant_flood  # noqa: E402
from mooncake_server import require_mooncake  # noqa: E402

from lmcache_backend_mooncake import create_mooncake_backend  # noqa: E402
from lmcache_backend_mooncake.backend import MooncakeBackend  # noqa: E402
from lmcache_backend_mooncake.frames import frame_parts  # noqa: E402
from lmcache_backend_mooncake.local import LocalMaster, LocalSegmentOwner, LocalTenantMaster, free_port  # noqa: E402
from lmcache_core.backend import BackendContext, BackendError, EraseMatch  # noqa: E402
from lmcache_core.config import ConfigError, CoreConfig  # noqa: E402
from lmcache_core.keys import ChunkKey, KeyNamespace  # noqa: E402
from lmcache_core.serde import RawCodec  # noqa: E402
from lmcache_core.testing import make_context  # noqa: E402

CHUNK = 128 << 10  # payload bytes per chunk
QUOTA = 2 << 20  # flood's and calm's quota: 15 chunks
POOL_MIB = 16  # the segment owner's DRAM: less than the flood (20 MiB)
CALM_CHUNKS = 12
FLOOD_CHUNKS = 10 * QUOTA // CHUNK  # 160, 80 per writer
LEASE_MS = 500  # a read's lease; calm's chunks are read, then left alone this long, before each flood
SAMPLES_MAX = 5000
FLOOD_DEADLINE_S = 60.0
OPTIONS = {"staging_size": "4MiB", "buffer_size": "4MiB", "setup_timeout_s": 10.0}


def _metric(text: str, name: str, tenant: str | None = None) -> int:
    label = "" if tenant is None else rf'\{{tenant_id="{re.escape(tenant)}"\}}'
    m = re.search(rf"^{name}{label} (\S+)$", text, re.M)
    assert m is not None, f"no {name}{label} in the master's metrics"
    return int(float(m.group(1)))


class Store:
    """A master (with or without tenant quotas) and one segment owner of POOL_MIB."""

    def __init__(self, workdir: Path, quotas: dict[str, int] | None) -> None:
        require_mooncake()
        self.master = (
            LocalMaster(workdir, lease_ttl_ms=LEASE_MS)
            if quotas is None
            else LocalTenantMaster(workdir, quotas, lease_ttl_ms=LEASE_MS)
        )
        try:
            self.owner = LocalSegmentOwner(self.master, size_mib=POOL_MIB)
        except BaseException:
            self.master.kill()
            raise
        self.quotas = quotas

    def metrics(self) -> str:
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with direct.open(self.master.metrics_url + "/metrics", timeout=5) as reply:
            return str(reply.read().decode())

    def tier(self, tenant: str | None, **options: Any) -> MooncakeBackend:
        if self.quotas is not None:
            options = {"tenant_quota": True, "master_metrics": self.master.metrics_url, **options}
        section = self.master.options(**{**OPTIONS, **options})
        backend = create_mooncake_backend(section, _ctx(tenant))
        assert isinstance(backend, MooncakeBackend)
        return backend

    def stop(self) -> None:
        self.owner.kill()
        self.master.kill()


def _ctx(tenant: str | None) -> BackendContext:
    return dataclasses.replace(make_context(4 << 20, key_path="backends[1]"), config=CoreConfig(tenant=tenant))


@pytest.fixture(scope="module")
def quota_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    store = Store(tmp_path_factory.mktemp("mc-quota"), {"flood": QUOTA, "calm": QUOTA})
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture(scope="module")
def plain_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    store = Store(tmp_path_factory.mktemp("mc-plain"), None)
    try:
        yield store
    finally:
        store.stop()


def _ns(tenant: str) -> KeyNamespace:
    return KeyNamespace(model="m", layout="t", dtype="u8", salt=f"{tenant}-salt")


def _key(tenant: str, i: int) -> ChunkKey:
    return _ns(tenant).key(i.to_bytes(16, "little"))


def _chunk(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _frame_len() -> int:
    header, payload, _ = frame_parts(_key("x", 0), _chunk(0), RawCodec())
    return len(header) + payload.nbytes


def _hits(tier: MooncakeBackend, tenant: str, n: int) -> int:
    out = torch.empty(CHUNK, dtype=torch.uint8)
    return sum(tier.get(_key(tenant, i), out) and torch.equal(out, _chunk(i)) for i in range(n))


def _calm(store: Store) -> MooncakeBackend:
    calm = store.tier("calm")
    assert calm.put_many([(_key("calm", i), _chunk(i)) for i in range(CALM_CHUNKS)]) == [True] * CALM_CHUNKS
    assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS
    time.sleep(LEASE_MS / 1000 + 0.3)  # the reads' leases are over: calm's chunks can be evicted (by the control)
    return calm


@dataclasses.dataclass
class Sample:
    flood: int  # flood's charged bytes (the master's quota account); 0 without quotas
    calm: int  # calm's charged bytes
    allocated: int  # the pool's allocated bytes (the allocator's)
    evicted: int  # objects the master evicted pool-wide (watermark), since it started


class Flood:
    """Two writers of tenant ``flood`` writing 10x QUOTA between them, and a sampler of
    the master's metrics running meanwhile (bounded in count and time)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.samples: list[Sample] = []
        self.stored: list[bool] = []  # one per put: whether it was stored

    def sample(self) -> Sample:
        text = self.store.metrics()
        quotas = self.store.quotas is not None
        return Sample(
            _metric(text, "mooncake_tenant_quota_charged_bytes", "flood") if quotas else 0,
            _metric(text, "mooncake_tenant_quota_charged_bytes", "calm") if quotas else 0,
            _metric(text, "master_allocated_bytes"),
            _metric(text, "master_evicted_key_count"),
        )

    def run(self) -> list[MooncakeBackend]:
        writers = [self.store.tier("flood") for _ in range(2)]
        self.samples = tenant_flood.flood(
            writers,
            lambda w, i: self.stored.append(w.put(_key("flood", i), _chunk(i))),
            FLOOD_CHUNKS,
            self.sample,
            deadline_s=FLOOD_DEADLINE_S,
            samples_max=SAMPLES_MAX,
        )
        return writers


def test_a_tenant_writing_10x_its_quota_moves_no_other_tenant(quota_store: Store) -> None:
    calm = _calm(quota_store)
    writers: list[MooncakeBackend] = []
    try:
        flood = Flood(quota_store)
        before = flood.sample()
        assert before.flood == 0 and before.calm == before.allocated == CALM_CHUNKS * _frame_len()
        writers = flood.run()
        s = flood.samples
        # the flood's bytes at each sample: the master's account, and the allocator's less calm's
        flood_real = [x.allocated - before.calm for x in s]
        print(
            f"\nmooncake quota flood: {len(s)} samples, {sum(flood.stored)} of {FLOOD_CHUNKS} puts stored, flood's peak "
            f"{max(x.flood for x in s)} charged / {max(flood_real)} allocated bytes, quota {QUOTA}, "
            f"calm {before.calm} bytes throughout"
        )
        assert len(s) >= 20, len(s)
        assert all(x.flood <= QUOTA for x in s), s  # the quota, as the master keeps it: at every sample
        # The allocator frees an evicted object's memory just after the master's account
        # drops it: a sample may catch one such object (in 3 of 12 runs, exactly one
        # frame over the account), never more.
        assert all(real <= x.flood + _frame_len() and real <= QUOTA + _frame_len() for x, real in zip(s, flood_real)), s
        assert all(x.calm == before.calm for x in s), s  # calm's bytes: unmoved at every sample
        assert all(x.evicted == before.evicted for x in s), s  # the quota bounded flood, not the pool's watermark
        assert s[-1].flood > QUOTA // 2  # flood did fill its share
        assert sum(flood.stored) > FLOOD_CHUNKS // 2  # ... by evicting its own chunks, not by being refused
        usage = writers[0].quota_usage()
        assert usage is not None and usage.effective == usage.requested == QUOTA and usage.evicted > 0
        st = writers[0].stats()
        assert st.bytes_capacity == QUOTA and st.bytes_used == usage.charged == s[-1].flood
        assert st.extra["quota_tenant"] == "flood" and st.extra["tenant_not_registered"] == 0
        # what flood's own client finds of its chunks is within the quota too
        present = sum(
            writers[1].contains([_key("flood", i)]) for i in range(tenant_flood.FIRST, tenant_flood.FIRST + FLOOD_CHUNKS)
        )
        assert 0 < present * _frame_len() <= QUOTA
        assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS  # calm's hit rate: unmoved, byte for byte
        # namespaces: calm sees none of flood's chunks, and flood's erase removes flood's own only
        assert calm.contains([_key("flood", tenant_flood.FIRST + FLOOD_CHUNKS - 1)]) == 0
        assert writers[0].erase(EraseMatch()) == present
        assert _hits(calm, "calm", CALM_CHUNKS) == CALM_CHUNKS
        assert flood.sample().flood == 0
    finally:
        for w in writers:
            w.close()
        calm.close()


def test_negative_control_without_tenant_quotas_the_flood_evicts_the_other_tenant(plain_store: Store) -> None:
    calm = _calm(plain_store)
    try:
        flood = Flood(plain_store)
        before = flood.sample()
        for w in flood.run():
            w.close()
        hits = _hits(calm, "calm", CALM_CHUNKS)
        evicted = flood.sample().evicted - before.evicted
        print(f"\nno tenant quotas: calm hits {hits}/{CALM_CHUNKS}, master evicted {evicted} objects pool-wide")
        assert hits < CALM_CHUNKS // 2, hits
        assert evicted > 0
    finally:
        calm.close()


# -- configuration errors and edge cases ---------------------------------------------------------


def test_a_quota_needs_the_engines_tenant_label() -> None:
    section = {"master": "127.0.0.1:1", "metadata": "http://127.0.0.1:1/metadata", "tenant_quota": True}
    with pytest.raises(ConfigError, match=r"backends\[1\]\.tenant_quota: .*no tenant label") as err:
        create_mooncake_backend(section, _ctx(None))
    assert "(from test)" in str(err.value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tenant_quota": "2GiB"}, r"backends\[1\]\.tenant_quota: .*set on the master"),
        ({"tenant_quota": True, "master_metrics": "127.0.0.1:9003"}, r"backends\[1\]\.master_metrics: .*http://host:port"),
        ({"tenant_quota": True, "master_metrics": "http://h:0"}, r"backends\[1\]\.master_metrics: .*http://host:port"),
        ({"master_metrics": "http://h:9003"}, r"master_metrics is only used with tenant_quota: true"),
    ],
)
def test_bad_quota_keys_name_the_key(options: dict[str, Any], message: str) -> None:
    section = {"master": "127.0.0.1:1", "metadata": "http://127.0.0.1:1/metadata", **options}
    with pytest.raises(ConfigError, match=message):
        create_mooncake_backend(section, _ctx("a"))


def test_a_master_without_tenant_quotas_fails_startup(plain_store: Store) -> None:
    section = plain_store.master.options(**OPTIONS, tenant_quota=True, master_metrics=plain_store.master.metrics_url)
    with pytest.raises(BackendError, match=r"backends\[1\]\.tenant_quota .*keeps no tenant quotas.*--enable_multi_tenants"):
        create_mooncake_backend(section, _ctx("calm"))


def test_a_tenant_the_policy_does_not_list_fails_startup(quota_store: Store) -> None:
    with pytest.raises(BackendError, match=r"has no quota for tenant 'stranger' \(it lists 'calm', 'flood'\)"):
        quota_store.tier("stranger")


def test_an_unreadable_metrics_server_fails_startup_with_the_key_to_set(quota_store: Store) -> None:
    with pytest.raises(BackendError, match=r"cannot read the master's metrics .*Set backends\[1\]\.master_metrics"):
        quota_store.tier("calm", master_metrics=f"http://127.0.0.1:{free_port()}")


def test_without_verify_on_start_an_unlisted_tenants_puts_are_skipped_and_counted(quota_store: Store) -> None:
    tier = quota_store.tier("stranger", verify_on_start=False)
    try:
        assert tier.put_many([(_key("stranger", i), _chunk(i)) for i in range(3)]) == [False] * 3
        s = tier.stats()
        assert s.extra["tenant_not_registered"] == 3 == s.skipped and s.puts == 0 and s.errors == 0
        assert tier.contains([_key("stranger", 0)]) == 0
    finally:
        tier.close()
