"""A cache node's metrics (``GET /metrics`` on its admin API): Prometheus' text format,
parsed by prometheus_client's own parser, equal to ``/status`` (per tenant included),
behind the bearer token; and scraped by a real Prometheus (Debian's) with the token
in a ``credentials_file``, per-tenant usage queried back from it.

Negative controls: without the token the endpoint answers 401 and a Prometheus
scraping without credentials sees the target down."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from test_peer_admin import TOKEN, Admin, client, frame, key, private_file  # noqa: E402

from .prom import MISSING, prometheus  # noqa: E402

ALICE = ("alice", "alice-secret-0123456789abcdef")
BOB = ("bob", "bob-secret-0123456789abcdefgh")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Admin]:
    tmp = tmp_path_factory.mktemp("metrics")
    tenants = private_file(tmp / "tenants", f"{ALICE[0]} {ALICE[1]} quota=8KiB\n{BOB[0]} {BOB[1]}\n")
    a = Admin(tmp, ["--max-size", "1MiB", "--tenants-file", str(tenants)])
    for (tenant, secret), n in ((ALICE, 30), (BOB, 5)):  # alice writes past her quota
        c = client(a, secret=secret, tenant=tenant)
        ns = os.urandom(16)
        for i in range(n):
            k = key(ns, i)
            c.put(k, frame(k))
        c.close()
    yield a
    a.stop()


def _scrape(a: Admin, token: str | None = TOKEN) -> tuple[int, str, str]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    return resp.status, resp.getheader("Content-Type") or "", body


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples
    }


def test_metrics_match_the_status_per_tenant(node: Admin) -> None:
    code, ctype, text = _scrape(node)
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4"), (code, ctype)
    got = _samples(text)
    _, status = node.request("GET", "/status")
    tier = status["tiers"][0]
    assert got[("lmcache_node_bytes", ())] == tier["bytes"] and got[("lmcache_node_chunks", ())] == tier["chunks"]
    assert got[("lmcache_node_max_bytes", ())] == 1 << 20
    for tenant, row in status["tenants"].items():
        labels = (("tenant", tenant),)
        assert got[("lmcache_node_tenant_bytes", labels)] == row["bytes"], tenant
        assert got[("lmcache_node_tenant_chunks", labels)] == row["chunks"], tenant
        assert (("lmcache_node_tenant_quota_bytes", labels) in got) == (row["quota"] is not None), tenant
    alice = (("tenant", "alice"),)
    assert got[("lmcache_node_tenant_quota_bytes", alice)] == 8 << 10
    assert got[("lmcache_node_tenant_bytes", alice)] <= 8 << 10
    assert got[("lmcache_node_tenant_self_evictions_total", alice)] > 0  # she wrote past her quota
    assert got[("lmcache_node_tenant_chunks", (("tenant", "bob"),))] == 5
    # the control: no token, no metrics
    code, _, text = _scrape(node, token=None)
    assert code == 401 and "lmcache_node" not in text


@pytest.mark.skipif(shutil.which("prometheus") is None, reason=MISSING)
def test_a_real_prometheus_scrapes_the_node_with_its_token(node: Admin, tmp_path: Path) -> None:
    token = private_file(tmp_path / "token", TOKEN + "\n")
    (tmp_path / "with").mkdir()
    target = f"127.0.0.1:{node.port}"
    with prometheus(target, tmp_path / "with", job="node", authorization={"credentials_file": str(token)}) as prom:
        rows: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while not rows and time.monotonic() < deadline:
            rows = prom.query('lmcache_node_tenant_chunks{job="node"}')
            time.sleep(0.5)
        by_tenant = {r["metric"]["tenant"]: float(r["value"][1]) for r in rows}
        _, status = node.request("GET", "/status")
        assert by_tenant == {t: row["chunks"] for t, row in status["tenants"].items()}, by_tenant
    # the control: without the credentials the scrape is refused (the target is down)
    (tmp_path / "without").mkdir()
    with pytest.raises(AssertionError, match="did not scrape"):
        with prometheus(target, tmp_path / "without", job="node", wait_s=8):
            pass
