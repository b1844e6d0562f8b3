"""TLS: a redis-server with only a TLS port on loopback, certificates made by the
``openssl`` CLI for the test. ``rediss://`` with the test CA stores and reads chunks; a
client certificate is accepted by a server that requires one; without the CA (the
system's CAs do not know it) the tier fails at startup with one TLS error; a
three-master cluster over TLS (``tls: true``) serves chunks from every master."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, free_port  # noqa: E402

from lmcache_backend_redis import create_redis_backend  # noqa: E402
from lmcache_core.backend import BackendError  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=lmcache test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            f"{name}.crt",
            cwd=d,
        )
    return d


def _tls_server(certs: Path, auth_clients: str) -> tuple[RedisServer, int]:
    tls_port = free_port()
    server = RedisServer(
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(certs / "server.crt"),
        "--tls-key-file",
        str(certs / "server.key"),
        "--tls-ca-cert-file",
        str(certs / "ca.crt"),
        "--tls-auth-clients",
        auth_clients,
    )
    return server, tls_port


def _roundtrip(section: dict[str, Any]) -> None:
    b = create_redis_backend(section, make_context(key_path="backends[1]"))
    try:
        key, data = random_key(), random_chunk(shape=(64, 64))
        assert b.put(key, data)
        out = torch.empty_like(data)
        assert b.get(key, out) and torch.equal(out, data)
        assert b.stats().extra["server_down"] is False
    finally:
        b.close()


def test_rediss_with_ca_and_client_certificate(certs: Path) -> None:
    server, tls_port = _tls_server(certs, "yes")
    try:
        _roundtrip(
            {
                "url": f"rediss://127.0.0.1:{tls_port}/0",
                "tls_ca_file": str(certs / "ca.crt"),
                "tls_cert_file": str(certs / "client.crt"),
                "tls_key_file": str(certs / "client.key"),
            }
        )
    finally:
        server.stop()


def test_unknown_ca_is_one_clear_error(certs: Path) -> None:
    server, tls_port = _tls_server(certs, "no")
    try:
        _roundtrip({"url": f"rediss://127.0.0.1:{tls_port}/0", "tls_ca_file": str(certs / "ca.crt")})  # control
        with pytest.raises(BackendError, match="TLS handshake") as err:
            create_redis_backend({"url": f"rediss://127.0.0.1:{tls_port}/0"}, make_context(key_path="backends[1]"))
        assert "backends[1].tls_ca_file" in str(err.value)
    finally:
        server.stop()


def test_cluster_over_tls(certs: Path) -> None:
    """Three TLS masters (``tls-cluster yes``): the cluster announces its TLS ports and
    the tier (``tls: true``) spreads chunks over all of them."""
    tls_ports = [free_port(55535) for _ in range(3)]
    nodes: list[RedisServer] = []
    try:
        for tp in tls_ports:
            nodes.append(
                RedisServer(
                    "--tls-port",
                    str(tp),
                    "--tls-cert-file",
                    str(certs / "server.crt"),
                    "--tls-key-file",
                    str(certs / "server.key"),
                    "--tls-ca-cert-file",
                    str(certs / "ca.crt"),
                    "--tls-auth-clients",
                    "no",
                    "--tls-cluster",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                )
            )
        clients = [n.client() for n in nodes]
        for i, c in enumerate(clients):
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * 16384 // 3, (i + 1) * 16384 // 3 - 1)
        for tp in tls_ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", tp)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # bounded: the cluster forms over TLS
            infos = [c.execute_command("CLUSTER", "INFO").decode() for c in clients]
            if all("cluster_state:ok" in i and "cluster_known_nodes:3" in i for i in infos):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the TLS cluster did not form within 20 s")
        section = {
            "cluster": [f"127.0.0.1:{tp}" for tp in tls_ports],
            "tls": True,
            "tls_ca_file": str(certs / "ca.crt"),
            "prefix": "tlsc:",
        }
        b = create_redis_backend(section, make_context())
        try:
            items = [(random_key(), random_chunk(shape=(16, 16), seed=i)) for i in range(24)]
            assert b.put_many(items) == [True] * 24
            outs = [torch.empty(16, 16, dtype=torch.float16) for _ in items]
            assert b.get_many([k for k, _ in items], outs) == [True] * 24
            assert all(torch.equal(o, d) for o, (_, d) in zip(outs, items))
            assert min(len(c.keys("tlsc:*")) for c in clients) > 0  # every master holds some
        finally:
            b.close()
    finally:
        for n in nodes:
            n.stop()
