"""Retaining chunks on a cache node for a while (``POST /retain``, ``POST /release``,
``lmcache-core admin retain|release``):

* in the store and in shared-memory arenas, eviction (node-wide, or a tenant's own
  within its quota) passes over a retained chunk until its time is up; an expired
  retention is an ordinary chunk again; a key retained before it arrives is retained
  when it does; retained bytes stay within ``RETAIN_SHARE`` of the store (the weakest
  released past it); a put that finds only retained chunks to evict is refused and
  counted, never another tenant's chunk taken;
* on a real node over loopback, through the API and the command: retained chunks
  survive a flood of 4x the node's budget, released ones do not; a tenant's retention
  applies to that tenant's chunks only; bad bodies get 400, an unknown tenant 404.

Negative controls: the same floods without a retention evict the very chunks the
retention kept (so the floods are large enough to matter).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_peer_admin import Admin, admin_cli, client, frame, key, private_file  # noqa: E402

from lmcache_backend_peer.shm import SHM_SUPPORTED, Arena  # noqa: E402
from lmcache_backend_peer.store import RETAIN_SHARE, FrameStore  # noqa: E402
from lmcache_core.retention import Retention  # noqa: E402
from lmcache_core.testing import ManualClock, random_key  # noqa: E402

FRAME = 1000


def _store(max_size: int, quotas: dict[str | None, int] | None = None) -> tuple[FrameStore, ManualClock]:
    store = FrameStore(max_size, quotas)
    clock = ManualClock()
    store.retention = Retention(max_size, RETAIN_SHARE, clock=clock)
    return store, clock


def _fill(store: FrameStore, n: int, owner: str | None = None) -> list[Any]:
    keys = [random_key(f"fill-{owner}") for _ in range(n)]
    for k in keys:
        store.put_frame(k, bytes(FRAME), owner=owner)
    return keys


@pytest.mark.parametrize("retain", [True, False], ids=["retained", "control"])
def test_retained_chunks_outlive_eviction_until_their_time_is_up(retain: bool) -> None:
    store, clock = _store(20 * FRAME)
    kept = _fill(store, 5)
    if retain:
        assert store.retain(kept, seconds=60) == 5
    _fill(store, 100)  # 5x the store
    held = sum(store.get_frame(k) is not None for k in kept)
    assert held == (5 if retain else 0)
    assert store.bytes_used <= store.max_size
    if retain:
        clock.now += 61  # expired: ordinary chunks again
        _fill(store, 100)
        assert sum(store.get_frame(k) is not None for k in kept) == 0
        assert store.retention_stats()["retained"] == 0


def test_release_ends_a_retention_and_a_pending_one_applies_on_arrival() -> None:
    store, _ = _store(20 * FRAME)
    early = random_key("early")
    assert store.retain([early], seconds=60) == 0  # not held yet: pending
    store.put_frame(early, bytes(FRAME))
    kept = _fill(store, 3)
    store.retain(kept, seconds=60)
    assert store.release(kept[:1]) == 1 and store.release(kept[:1]) == 0
    _fill(store, 100)
    assert store.get_frame(early) is not None  # retained when it arrived
    assert [store.get_frame(k) is not None for k in kept] == [False, True, True]


def test_retained_bytes_stay_within_their_share_weakest_released() -> None:
    store, _ = _store(20 * FRAME)
    weak = _fill(store, 8)
    strong = _fill(store, 8)
    store.retain(weak, seconds=60, priority=1)
    store.retain(strong, seconds=60, priority=50)
    stats = store.retention_stats()
    assert stats["retained_bytes"] <= RETAIN_SHARE * store.max_size
    assert stats["retention_released"] == 6  # 16 asked, 10 fit: the 6 weakest went
    _fill(store, 100)
    assert all(store.get_frame(k) is not None for k in strong)
    assert sum(store.get_frame(k) is not None for k in weak) == 2


def test_a_tenant_whose_own_chunks_are_all_retained_is_refused_never_another_evicted() -> None:
    store, _ = _store(100 * FRAME, {"flood": 4 * FRAME})
    calm = _fill(store, 20, owner="calm")
    mine = _fill(store, 4, owner="flood")
    store.retain(mine, seconds=60)
    refused = store.refused["flood"]
    for _ in range(40):
        assert not store.put_frame(random_key("more"), bytes(FRAME), owner="flood")
    assert store.refused["flood"] == refused + 40
    assert all(store.get_frame(k) is not None for k in calm + mine)
    assert store.usage()["flood"]["bytes"] <= 4 * FRAME


@pytest.mark.skipif(not SHM_SUPPORTED, reason="no memfd_create / sealing here")
@pytest.mark.parametrize("retain", [True, False], ids=["retained", "control"])
def test_an_arena_passes_over_retained_slots(retain: bool) -> None:
    arena = Arena("retain-test", 64 * 1024)
    try:
        kept = [key(b"\x01" * 16, i) for i in range(4)]
        for k in kept:
            assert arena.put_frame(k, frame(k))
        if retain:
            assert arena.retain(kept, seconds=60) == 4
        for i in range(200):  # many times the arena
            k = key(b"\x02" * 16, i)
            assert arena.put_frame(k, frame(k))
        assert arena.contains(kept[:1]) == (1 if retain else 0)
        assert sum(arena.get_frame(k) is not None for k in kept) == (4 if retain else 0)
        assert arena.bytes_used <= arena.size
    finally:
        arena.close()


# -- a real node, through the API and the command -----------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Admin]:
    tmp = tmp_path_factory.mktemp("retain")
    tenants = private_file(tmp / "tenants", "alice alice-secret-0123456789abcdef\nbob bob-secret-0123456789abcdefgh\n")
    a = Admin(tmp, ["--max-size", "256KiB", "--tenants-file", str(tenants)])
    yield a
    a.stop()


def _flood(a: Admin, tenant: str, secret: str, n: int) -> None:
    c = client(a, secret=secret, tenant=tenant)
    try:
        ns = os.urandom(16)
        for i in range(n):
            k = key(ns, i)
            c.put(k, frame(k))
    finally:
        c.close()


def _held(a: Admin, keys: list[Any], tenant: str) -> list[bool]:
    code, body = a.request("GET", "/lookup?keys=" + ",".join(str(k) for k in keys) + f"&tenant={tenant}")
    assert code == 200, body
    return body["held"]


def test_the_api_retains_a_tenants_chunks_through_a_flood_and_releases_them(small: Admin) -> None:
    alice, bob = ("alice", "alice-secret-0123456789abcdef"), ("bob", "bob-secret-0123456789abcdefgh")
    ns = os.urandom(16)
    kept, loose = [key(ns, i) for i in range(4)], [key(ns, i) for i in range(4, 8)]
    c = client(small, secret=alice[1], tenant=alice[0])
    for k in kept + loose:
        assert c.put(k, frame(k))
    c.close()
    names = [str(k) for k in kept]
    # bob's retention of the same keys names bob's chunks (none held), not alice's
    code, body = small.request("POST", "/retain", {"keys": names, "seconds": 300, "tenant": "bob"})
    assert code == 200 and body["retained"] == 0 and body["pending"] == 4, body
    out = admin_cli(small, "retain", *names, "--seconds", "300", "--tenant", "alice")
    assert out.returncode == 0 and json.loads(out.stdout)["retained"] == 4, out.stdout + out.stderr
    _, status = small.request("GET", "/status")
    assert status["tiers"][0]["retained"] == 4
    _flood(small, *bob, 4 * 256 * 1024 // len(frame(kept[0])))  # 4x the node
    assert _held(small, kept, "alice") == [True] * 4
    assert _held(small, loose, "alice") == [False] * 4  # the control: the flood evicts what is not retained
    out = admin_cli(small, "release", *names, "--tenant", "alice")
    assert out.returncode == 0 and json.loads(out.stdout)["released"] == 4, out.stdout + out.stderr
    _flood(small, *bob, 4 * 256 * 1024 // len(frame(kept[0])))
    assert _held(small, kept, "alice") == [False] * 4


K = "v1-" + "00" * 16 + "-" + "11" * 16


@pytest.mark.parametrize(
    "path, body, code",
    [
        ("/retain", {"keys": [K]}, 400),  # no time limit
        ("/retain", {"keys": [K], "seconds": 0}, 400),
        ("/retain", {"keys": [K], "seconds": 31 * 24 * 3600}, 400),
        ("/retain", {"keys": [K], "seconds": True}, 400),
        ("/retain", {"keys": [K], "seconds": 5, "priority": 100}, 400),
        ("/retain", {"keys": [], "seconds": 5}, 400),
        ("/retain", {"keys": [K] * 513, "seconds": 5}, 400),
        ("/retain", {"keys": ["v1-zz"], "seconds": 5}, 400),
        ("/retain", {"keys": [7], "seconds": 5}, 400),
        ("/retain", {"keys": [K], "seconds": 5, "tenant": "carol"}, 404),
        ("/retain", {"keys": [K], "seconds": 5, "tenant": ["alice"]}, 400),
        ("/retain", {"keys": [K], "seconds": 5, "extra": 1}, 400),
        ("/release", {"keys": K}, 400),
        ("/release", {"keys": [K], "seconds": 5}, 400),
        ("/release", {"keys": [K], "tenant": "carol"}, 404),
        ("/release", {"keys": [K], "tenant": "alice"}, 200),  # the control: a good body
    ],
)
def test_retain_and_release_refuse_bad_bodies(small: Admin, path: str, body: Any, code: int) -> None:
    assert small.request("POST", path, body)[0] == code
