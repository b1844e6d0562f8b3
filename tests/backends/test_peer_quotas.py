"""Hard per-tenant quotas on a shared peer node (``--tenant-quota SIZE``, or
``quota=SIZE`` on a tenants-file line):

* a tenant at its quota evicts its own least recently used chunks, never another
  principal's; a chunk larger than its quota is refused (counted);
* a tenant flooding the node with 10x its quota moves neither another tenant's usage
  nor its hits, and its own usage stays within its quota at every sample (checked on
  a real ``lmcache-core serve`` over loopback, usage read from its admin API's
  ``/status``, and on the store in this process);
* per-owner usage (chunks, bytes, quota, refused puts, self-evictions) is reported in
  O(owners) and returns to zero when chunks are removed or erased;
* bad quotas are refused at start with the file and line named.

Negative control: with no quota the same flood does displace the other tenant, so the
flood is large enough to matter.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_clients import MALLORY, MALLORY_SECRET, VICTIM, VICTIM_SECRET, start_node  # noqa: E402
from peer_node import PeerNode, first_line  # noqa: E402

from lmcache_backend_peer import create_peer_backend  # noqa: E402
from lmcache_backend_peer.backend import PeerBackend  # noqa: E402
from lmcache_backend_peer.store import FrameStore  # noqa: E402
from lmcache_backend_peer.tenants import parse_quotas, parse_tenants  # noqa: E402
from lmcache_core.backend import EraseMatch  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

FRAME = 1000  # bytes of each frame in the in-process store tests
CHUNK_SHAPE = (4, 2, 64, 32)  # 32 KiB of fp16 per chunk on the node
TOKEN = "quota-admin-token-0123456789abcdef"


def _fill(store: FrameStore, owner: str | None, n: int, tag: int) -> list:
    keys = [random_key(f"{owner}-{tag}") for _ in range(n)]
    for k in keys:
        assert store.put_frame(k, bytes(FRAME), owner=owner) or store.quotas.get(owner, 1 << 62) < FRAME
    return keys


def test_a_tenant_at_its_quota_evicts_its_own_least_recently_used_chunks() -> None:
    store = FrameStore(100 * FRAME, {"flood": 10 * FRAME})
    calm = _fill(store, "calm", 20, 0)
    first = _fill(store, "flood", 10, 1)
    assert store.get_frame(first[0]) is not None  # read: now the most recently used of flood's
    for i in range(100):  # 10x its quota
        _fill(store, "flood", 1, 2 + i)
        assert (store.usage()["flood"]["bytes"] or 0) <= 10 * FRAME
    assert store.contains(calm) == 20 and all(store.get_frame(k) is not None for k in calm)
    u = store.usage()
    assert u["flood"] == {"chunks": 10, "bytes": 10 * FRAME, "quota": 10 * FRAME, "refused": 0, "self_evictions": 100}
    assert u["calm"]["bytes"] == 20 * FRAME and u["calm"]["quota"] is None
    assert store.contains([first[0]]) == 0, "the recently read chunk outlived the newer ones: not LRU"
    assert store.put_frame(random_key(), bytes(11 * FRAME), owner="flood") is False
    assert store.usage()["flood"]["refused"] == 1


def test_without_quotas_the_flood_displaces_the_other_tenant() -> None:
    """Negative control for the test above: the same flood, no quota."""
    store = FrameStore(100 * FRAME)
    calm = _fill(store, "calm", 20, 0)
    for i in range(100):
        _fill(store, "flood", 1, i)
    assert store.contains(calm) == 0
    assert store.usage()["calm"]["chunks"] == 0


def test_usage_returns_to_zero_on_remove_and_erase() -> None:
    store = FrameStore(100 * FRAME, {"a": 50 * FRAME})
    keys = _fill(store, "a", 5, 0)
    assert store.remove(keys[0]) and store.usage()["a"]["bytes"] == 4 * FRAME
    assert store.erase(EraseMatch(None)) == 4
    u = store.usage()["a"]
    assert (u["chunks"], u["bytes"], store.bytes_used, len(store)) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="quotas must be positive"):
        FrameStore(10, {"a": 0})


def test_tenants_file_quotas_and_their_errors() -> None:
    text = f"{VICTIM} {VICTIM_SECRET} quota=2MiB\n{MALLORY} {MALLORY_SECRET}\n"
    assert parse_tenants(text, "t") == {VICTIM: VICTIM_SECRET.encode(), MALLORY: MALLORY_SECRET.encode()}
    assert parse_quotas(text, "t") == {VICTIM: 2 << 20}
    for bad, why in [("quota=0", "must be positive"), ("quota=lots", "quota"), ("size=1MiB", "expected quota=SIZE")]:
        with pytest.raises(ValueError, match=f"t:1: tenant '{VICTIM}': .*{why}"):
            parse_quotas(f"{VICTIM} {VICTIM_SECRET} {bad}\n", "t")


def _tier(node: PeerNode, secret: str, tenant: str) -> PeerBackend:
    section = {"peers": [node.address], "secret": secret, "tenant": tenant, "push": True, "max_size": 0, "timeout_s": 5.0}
    b = create_peer_backend(section, make_context())
    assert isinstance(b, PeerBackend)
    return b


class _Status:
    """The node's admin API (``--admin 127.0.0.1:0``): per-tenant usage from /status."""

    def __init__(self, node: PeerNode, token: str) -> None:
        assert node.proc is not None
        line = first_line(node.proc, "admin API on ", timeout=10)
        assert line is not None, "the node did not announce its admin API"
        self.port, self.token = int(line.rsplit(":", 1)[1]), token

    def tenants(self) -> dict[str, dict[str, int | None]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/status", headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == 200, body
            return body["tenants"]
        finally:
            conn.close()


@dataclass(frozen=True)
class _Flood:
    """What one flood did: the victim's (chunks, bytes, hits of 12) before and after,
    the flooder's largest sampled bytes, its quota and its self-evictions."""

    victim_before: tuple[int, int, int]
    victim_after: tuple[int, int, int]
    mallory_max: int
    mallory_quota: int | None
    mallory_self_evictions: int


def _usage(row: dict[str, int | None], hits: int) -> tuple[int, int, int]:
    return int(row["chunks"] or 0), int(row["bytes"] or 0), hits


def _flood(tmp: Path, quota: str | None) -> _Flood:
    """A node of 1 MiB shared by two tenants: the victim stores 12 chunks (0.4 of the
    node, within its own quota), then mallory writes 160 (10x a 512 KiB quota). The
    victim's usage (/status) and hits before and after; mallory's usage in bytes
    (/status) sampled every 8 writes."""
    tmp.mkdir(parents=True)
    (tmp / "tenants").write_text(f"{VICTIM} {VICTIM_SECRET}\n{MALLORY} {MALLORY_SECRET}\n")
    (tmp / "admin.token").write_text(TOKEN + "\n")
    os.chmod(tmp / "admin.token", 0o600)
    opts = ["--max-size", "1MiB", "--tenants-file", str(tmp / "tenants")]
    opts += ["--admin", "127.0.0.1:0", "--admin-token-file", str(tmp / "admin.token")]
    node = start_node(tmp, opts + (["--tenant-quota", quota] if quota else []))
    status = _Status(node, TOKEN)
    victim = _tier(node, VICTIM_SECRET, VICTIM)
    mallory = _tier(node, MALLORY_SECRET, MALLORY)
    deadline = time.monotonic() + 120
    try:
        calm = [random_key("victim") for _ in range(12)]
        data = random_chunk(CHUNK_SHAPE, seed=1)
        out = data.clone()
        assert all(victim.put(k, data) for k in calm)
        before = _usage(status.tenants()[VICTIM], sum(victim.get(k, out) for k in calm))
        samples: list[int] = []
        for i in range(160):  # bounded: 160 puts, and the deadline above
            mallory.put(random_key("mallory"), data)
            if i % 8 == 7:
                samples.append(int(status.tenants()[MALLORY]["bytes"] or 0))
            assert time.monotonic() < deadline, "the flood took over 120 s"
        after = status.tenants()
        victim_after = _usage(after[VICTIM], sum(victim.get(k, out) for k in calm))
        return _Flood(before, victim_after, max(samples), after[MALLORY]["quota"], int(after[MALLORY]["self_evictions"] or 0))
    finally:
        victim.close()
        mallory.close()
        node.stop()


def test_a_flood_at_10x_quota_moves_no_other_tenants_chunks_on_a_real_node(tmp_path: Path) -> None:
    q = _flood(tmp_path / "q", "512KiB")
    print("with quota:", q)
    assert q.victim_before == q.victim_after and q.victim_before[0] == q.victim_before[2] == 12, q
    assert q.mallory_quota == 512 << 10 and q.mallory_max <= q.mallory_quota, q
    assert q.mallory_self_evictions >= 160 - 16, q
    control = _flood(tmp_path / "none", None)
    print("without quota:", control)
    assert control.victim_before[0] == 12, control
    assert control.victim_after[0] < 12, f"the flood displaced nothing without quotas: {control}"
    assert control.mallory_max > 512 << 10, control


def test_a_quota_without_tenants_is_refused(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "lmcache_backend_peer.cli", "--listen", "127.0.0.1:0", "--tenant-quota", "1MiB"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LMCACHE_PEER_SECRET": "x" * 32},
    )
    assert p.returncode != 0 and "--tenant-quota needs --tenants-file" in p.stderr, p.stderr[-2000:]
