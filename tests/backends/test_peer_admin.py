"""The node's admin HTTP API (``lmcache-core serve --admin``), on a real node in a
child process, asked with a real HTTP client (:mod:`http.client`) on loopback.

Status answers with the token and 401 without it or with a wrong one; a token file
others can read, or ``--admin`` without a token file (loopback or not), stops the
node at start. An erase of one namespace through the API removes its chunks from the
node (a peer client's lookup then misses) while another namespace still hits, also
across tenants. A body over the limit gets 413 unread; a client that trickles its
request is cut off at the deadline; garbage requests never take the node down.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from lmcache_backend_peer import PeerClient
from lmcache_backend_peer.limits import MAX_BODY
from lmcache_backend_peer.shm import SHM_SUPPORTED
from lmcache_core.keys import ChunkKey
from lmcache_core.serde import RawCodec, encode

from peer_node import PeerNode, first_line

SECRET = "admin-test-secret-0123456789"
TOKEN = "admin-token-0123456789abcdefXYZ"
TIMEOUT_S = 1.0
N = 4  # chunks per namespace
NS_A, NS_B = bytes(range(16)), bytes(range(16, 32))


def key(ns: bytes, i: int) -> ChunkKey:
    return ChunkKey(ns, i.to_bytes(16, "big"))


def frame(k: ChunkKey) -> bytes:
    return encode(k, torch.full((2, 16, 8), 1.0, dtype=torch.float16), RawCodec())


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


class Admin:
    """A node started with ``--admin 127.0.0.1:0``, its admin port and a client."""

    def __init__(self, tmp: Path, options: list[str] = (), secret: bool = True, tls: tuple[Path, Path] | None = None) -> None:  # type: ignore[assignment]
        token = private_file(tmp / "admin.token", TOKEN + "\n")
        opts = [*options, "--admin", "127.0.0.1:0", "--admin-token-file", str(token), "--admin-timeout-s", str(TIMEOUT_S)]
        if tls is not None:
            opts += ["--admin-cert", str(tls[0]), "--admin-key", str(tls[1])]
        self.node = PeerNode(opts, private_file(tmp / "peer.secret", SECRET + "\n") if secret else None)
        assert self.node.proc is not None
        line = first_line(self.node.proc, "admin API on ", timeout=10)
        assert line is not None, "the node did not announce its admin API"
        self.url = line.split()[-1]
        self.port = int(self.url.rsplit(":", 1)[1])
        self.tls = tls

    def request(
        self, method: str, path: str, body: Any = None, token: str | None = TOKEN, raw: bytes | None = None
    ) -> tuple[int, Any]:
        if self.tls is not None:
            ctx = ssl.create_default_context(cafile=str(self.tls[0]))
            conn: http.client.HTTPConnection = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10, context=ctx)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, json.loads(payload) if payload else None
        finally:
            conn.close()

    def stop(self) -> None:
        self.node.stop()


@pytest.fixture(scope="module")
def admin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Admin]:
    a = Admin(tmp_path_factory.mktemp("admin"), ["--max-size", "16MiB"])
    yield a
    a.stop()


def client(a: Admin, secret: str = SECRET, tenant: str | None = None) -> PeerClient:
    return PeerClient(("127.0.0.1", a.node.port), secret.encode(), timeout=5.0, tenant=tenant)


def test_status_needs_the_right_token(admin: Admin) -> None:
    code, body = admin.request("GET", "/status")
    assert code == 200
    tier = body["tiers"][0]
    assert {"bytes", "chunks", "max_bytes", "evictions"} <= set(tier) and tier["max_bytes"] == 16 << 20
    assert {"lookup", "get", "locate"} == set(body["hits"])
    # negative controls: no token, a wrong one of the same length, another scheme
    assert admin.request("GET", "/status", token=None) == (401, {"error": "unauthorized"})
    assert admin.request("GET", "/status", token=TOKEN[:-1] + "Q")[0] == 401
    conn = http.client.HTTPConnection("127.0.0.1", admin.port, timeout=10)
    conn.request("GET", "/status", headers={"Authorization": f"Basic {TOKEN}"})
    assert conn.getresponse().status == 401
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", admin.port, timeout=10)
    conn.putrequest("GET", "/status")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Authorization", f"Bearer {TOKEN}")  # two: refused, whichever is right
    conn.endheaders()
    assert conn.getresponse().status == 401
    conn.close()
    # an unknown path is not told apart without the token
    assert admin.request("GET", "/nope", token=None)[0] == 401
    assert admin.request("GET", "/nope")[0] == 404


def test_erase_one_namespace_through_the_api(admin: Admin) -> None:
    c = client(admin)
    try:
        for ns in (NS_A, NS_B):
            for i in range(N):
                assert c.put(key(ns, i), frame(key(ns, i)))
        keys_a, keys_b = [key(NS_A, i) for i in range(N)], [key(NS_B, i) for i in range(N)]
        assert c.lookup(keys_a) == N and c.lookup(keys_b) == N
        code, body = admin.request("GET", "/lookup?keys=" + ",".join(str(k) for k in keys_a))
        assert code == 200 and body["held"] == [True] * N and body["prefix_held"] == N
        assert admin.request("POST", "/erase", {"namespaces": [NS_A.hex()], "dry_run": True}) == (
            200,
            {"would_erase": N, "dry_run": True, "tier": "node"},
        )
        assert c.lookup(keys_a) == N  # a dry run deletes nothing
        code, body = admin.request("POST", "/erase", {"namespaces": [NS_A.hex()]})
        assert code == 200 and body["erased"] == N
        assert c.lookup(keys_a) == 0 and c.get(keys_a) == [None] * N  # erased: misses
        assert c.lookup(keys_b) == N  # the other namespace still hits
        assert [bytes(f) if f is not None else None for f in c.get(keys_b)] == [frame(k) for k in keys_b]
        code, body = admin.request("GET", "/status")
        assert body["tiers"][0]["chunks"] == N and body["admin"]["erased_chunks"] == N
        assert body["hits"]["lookup"]["hits"] >= 3 * N  # the lookups above were counted
        code, body = admin.request("GET", "/lookup?keys=" + ",".join(str(k) for k in keys_a + keys_b))
        assert body["held"] == [False] * N + [True] * N and body["prefix_held"] == 0
        assert admin.request("POST", "/erase", {"all": True})[1]["erased"] == N
        assert c.lookup(keys_b) == 0
    finally:
        c.close()


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"namespaces": ["xyz"]},
        {"namespaces": [NS_A.hex().upper()]},
        {"namespaces": [], "all": True},
        {"all": True, "path": "/etc"},
        {"all": "yes"},
        {"tenant": "alice"},  # this node has no tenants
        {"tenant": "alice", "all": True},
        [1, 2],
    ],
)
def test_erase_refuses_bad_bodies(admin: Admin, body: Any) -> None:
    code, reply = admin.request("POST", "/erase", body)
    assert code == 400 and "error" in reply


def test_erase_across_tenants(tmp_path: Path) -> None:
    tenants = private_file(tmp_path / "tenants", "alice alice-secret-0123456789\nbob bob-secret-0123456789abc\n")
    a = Admin(tmp_path, ["--max-size", "16MiB", "--tenants-file", str(tenants)], secret=False)
    alice = client(a, "alice-secret-0123456789", "alice")
    bob = client(a, "bob-secret-0123456789abc", "bob")
    try:
        for c, spaces in ((alice, (NS_A, NS_B)), (bob, (NS_A,))):
            for ns in spaces:
                for i in range(N):
                    assert c.put(key(ns, i), frame(key(ns, i)))
        usage = a.request("GET", "/status")[1]["tenants"]
        assert usage["alice"]["chunks"] == 2 * N and usage["bob"]["chunks"] == N
        code, body = a.request("GET", f"/lookup?keys={key(NS_B, 0)}&tenant=bob")
        assert code == 200 and body["held"] == [False]  # bob never wrote NS_B
        assert a.request("GET", f"/lookup?keys={key(NS_B, 0)}&tenant=alice")[1]["held"] == [True]
        assert a.request("GET", f"/lookup?keys={key(NS_B, 0)}&tenant=eve")[0] == 404
        assert a.request("POST", "/erase", {"namespaces": [NS_A.hex()]})[1]["erased"] == 2 * N
        keys_a, keys_b = [key(NS_A, i) for i in range(N)], [key(NS_B, i) for i in range(N)]
        assert alice.lookup(keys_a) == 0 and bob.lookup(keys_a) == 0
        assert alice.lookup(keys_b) == N
        usage = a.request("GET", "/status")[1]["tenants"]
        assert usage["alice"]["chunks"] == N and usage["bob"]["chunks"] == 0
    finally:
        alice.close()
        bob.close()
        a.stop()


THREE = "alice alice-secret-0123456789\nbob bob-secret-0123456789abc\ncarol carol-secret-0123456789\n"
SECRETS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789abc", "carol": "carol-secret-0123456789"}


def _erase_one_tenant_of_three(a: Admin) -> None:
    """Each tenant writes N chunks in NS_A and NS_B (the same keys: tenants never
    share); erase bob: 0 of bob's chunks are left, all of alice's and carol's are."""
    clients = {t: client(a, s, t) for t, s in SECRETS.items()}
    keys = [key(ns, i) for ns in (NS_A, NS_B) for i in range(N)]
    try:
        for c in clients.values():
            for k in keys:
                assert c.put(k, frame(k))
        assert a.request("POST", "/erase", {"tenant": "bob", "dry_run": True})[1]["would_erase"] == 2 * N
        assert clients["bob"].lookup(keys) == 2 * N  # a dry run moves nothing
        assert a.request("POST", "/erase", {"tenant": "bob"})[1]["erased"] == 2 * N
        for t, c in clients.items():
            held = sum(c.lookup([k]) for k in keys)
            assert held == (0 if t == "bob" else 2 * N), t  # the others: the control
        usage = a.request("GET", "/status")[1]["tenants"]
        assert [usage[t]["chunks"] for t in SECRETS] == [2 * N, 0, 2 * N], usage
        assert a.request("POST", "/erase", {"tenant": "eve"})[0] == 404
    finally:
        for c in clients.values():
            c.close()


def test_erase_one_tenant_of_three(tmp_path: Path) -> None:
    tenants = private_file(tmp_path / "tenants", THREE)
    a = Admin(tmp_path, ["--max-size", "16MiB", "--tenants-file", str(tenants)], secret=False)
    try:
        _erase_one_tenant_of_three(a)
        out = admin_cli(a, "erase", "--tenant", "alice")  # and from the command line
        assert out.returncode == 0 and json.loads(out.stdout)["erased"] == 2 * N, out.stdout + out.stderr
        assert a.request("GET", "/status")[1]["tenants"]["carol"]["chunks"] == 2 * N
    finally:
        a.stop()


@pytest.mark.skipif(not SHM_SUPPORTED, reason="no shared-memory fast path on this host")
def test_erase_one_tenant_of_three_from_shared_memory_arenas(tmp_path: Path) -> None:
    sock = Path(tempfile.mkdtemp(prefix="adm", dir="/tmp")) / "node.sock"
    tenants = private_file(tmp_path / "tenants", THREE)
    a = Admin(tmp_path, ["--max-size", "16MiB", "--tenants-file", str(tenants), "--unix-socket", str(sock)], secret=False)
    try:
        assert a.request("GET", "/status")[1]["tiers"][0]["kind"] == "shared-memory arenas"
        _erase_one_tenant_of_three(a)
    finally:
        a.stop()
        shutil.rmtree(sock.parent, ignore_errors=True)


@pytest.mark.skipif(not SHM_SUPPORTED, reason="no shared-memory fast path on this host")
def test_erase_from_shared_memory_arenas(tmp_path: Path) -> None:
    sock = Path(tempfile.mkdtemp(prefix="adm", dir="/tmp")) / "node.sock"  # short: AF_UNIX paths are bounded
    a = Admin(tmp_path, ["--max-size", "16MiB", "--unix-socket", str(sock)])
    c = client(a)
    try:
        status = a.request("GET", "/status")[1]
        assert status["tiers"][0]["kind"] == "shared-memory arenas"
        for ns in (NS_A, NS_B):
            for i in range(N):
                assert c.put(key(ns, i), frame(key(ns, i)))
        assert a.request("POST", "/erase", {"namespaces": [NS_B.hex()]})[1]["erased"] == N
        assert c.lookup([key(NS_B, i) for i in range(N)]) == 0
        assert c.lookup([key(NS_A, i) for i in range(N)]) == N
        assert a.request("GET", "/status")[1]["tiers"][0]["chunks"] == N
    finally:
        c.close()
        a.stop()
        shutil.rmtree(sock.parent, ignore_errors=True)


def start_fails(tmp_path: Path, options: list[str]) -> str:
    """Start a node that must refuse to start: its stderr."""
    secret = private_file(tmp_path / "peer.secret", SECRET + "\n")
    exe = shutil.which("lmcache-core", path=os.path.dirname(sys.executable))
    assert exe, "install the core (pip install -e .) for its console script"
    proc = subprocess.run(
        [exe, "serve", "--listen", "127.0.0.1:0", "--secret-file", str(secret), *options],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "listening on" not in proc.stdout
    return proc.stderr


def test_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token = private_file(tmp_path / "token", TOKEN + "\n", mode=0o644)
    err = start_fails(tmp_path, ["--admin", "127.0.0.1:0", "--admin-token-file", str(token)])
    assert "mode 0644" in err and "chmod 600" in err
    os.chmod(token, 0o640)
    assert "mode 0640" in start_fails(tmp_path, ["--admin", "127.0.0.1:0", "--admin-token-file", str(token)])
    short = private_file(tmp_path / "short", "abc\n")
    assert "at least 16" in start_fails(tmp_path, ["--admin", "127.0.0.1:0", "--admin-token-file", str(short)])
    link = tmp_path / "link"
    link.symlink_to(private_file(tmp_path / "good", TOKEN))
    assert "symbolic link" in start_fails(tmp_path, ["--admin", "127.0.0.1:0", "--admin-token-file", str(link)])


def test_admin_without_a_token_is_refused(tmp_path: Path) -> None:
    err = start_fails(tmp_path, ["--admin", "0.0.0.0:0"])
    assert "--admin needs --admin-token-file" in err and "not loopback" in err
    # loopback too: every local user reaches it
    assert "--admin needs --admin-token-file" in start_fails(tmp_path, ["--admin", "127.0.0.1:0"])
    token = private_file(tmp_path / "token", TOKEN)
    assert "need --admin HOST:PORT" in start_fails(tmp_path, ["--admin-token-file", str(token)])


def test_oversize_body_gets_413_unread(admin: Admin) -> None:
    code, body = admin.request("POST", "/erase", raw=b"{" + b" " * MAX_BODY + b"}")
    assert code == 413 and "larger" in body["error"]
    assert admin.request("POST", "/erase", raw=b" " * (MAX_BODY + 1), token=None)[0] == 401
    assert admin.request("POST", "/erase", raw=b'{"all": true, "dry_run": true}')[0] == 200  # at the limit: fine


def _burst(a: Admin, n: int, token: str = TOKEN) -> list[tuple[int, str | None]]:
    """``n`` GET /status back to back: (status, Retry-After) of each."""
    out = []
    for _ in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)
        try:
            conn.request("GET", "/status", headers={"Authorization": f"Bearer {token}"})
            resp = conn.getresponse()
            resp.read()
            out.append((resp.status, resp.getheader("Retry-After")))
        finally:
            conn.close()
    return out


def test_requests_over_the_rate_get_429_and_the_rate_refills(tmp_path: Path) -> None:
    """``--admin-rate 5``: a burst of 10, then 5 a second, per client address; past it
    429 with Retry-After, before the token is looked at (so wrong tokens are limited
    too); after a pause requests go through again. The control: ``--admin-rate 0``."""
    (tmp_path / "limited").mkdir()
    (tmp_path / "unlimited").mkdir()
    a = Admin(tmp_path / "limited", ["--max-size", "1MiB", "--admin-rate", "5"])
    try:
        start = time.monotonic()
        first = _burst(a, 30)
        elapsed = time.monotonic() - start
        ok = sum(1 for code, _ in first if code == 200)
        limited = [(code, after) for code, after in first if code != 200]
        print(f"\nadmin rate 5/s: {ok} of 30 answered in {elapsed:.2f} s, {len(limited)} got 429")
        assert 10 <= ok <= 10 + 5 * elapsed + 1, (ok, elapsed)
        assert limited and all(code == 429 and after is not None and int(after) >= 1 for code, after in limited)
        # The limit comes first: a wrong token past the rate gets 429, not 401. The bucket
        # refills while the test runs (a stalled CI worker once let a third request in),
        # so only what could have refilled may reach the token check.
        start = time.monotonic()
        wrong = [code for code, _ in _burst(a, 20, token="wrong-token-wrong-token")]
        elapsed = time.monotonic() - start
        assert set(wrong) <= {401, 429} and 429 in wrong, wrong
        assert wrong.count(401) <= 5 * elapsed + 1, (wrong, elapsed)
        time.sleep(2.5)  # refills 10 tokens at most
        code, status = a.request("GET", "/status")
        assert code == 200 and status["admin"]["rate_limited"] >= len(limited) + wrong.count(429)
        assert [c for c, _ in _burst(a, 5)] == [200] * 5
    finally:
        a.stop()
    control = Admin(tmp_path / "unlimited", ["--max-size", "1MiB", "--admin-rate", "0"])
    try:
        assert [c for c, _ in _burst(control, 60)] == [200] * 60
    finally:
        control.stop()


def test_a_bad_admin_rate_is_a_usage_error(tmp_path: Path) -> None:
    token = private_file(tmp_path / "token", TOKEN)
    opts = ["--admin", "127.0.0.1:0", "--admin-token-file", str(token), "--admin-rate"]
    assert "--admin-rate: requests a second from 0 (no limit) to 100000, got -1" in start_fails(tmp_path, [*opts, "-1"])


def test_slow_client_is_cut_off(admin: Admin) -> None:
    sock = socket.create_connection(("127.0.0.1", admin.port), timeout=10)
    start = time.monotonic()
    closed_after = None
    try:
        sock.sendall(b"GET /status HTTP/1.1\r\n")
        # a header line every 0.2 s: each read completes well within the timeout
        while time.monotonic() - start < TIMEOUT_S + 4:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed_after = time.monotonic() - start
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(4096) == b"":
                    closed_after = time.monotonic() - start
                    break
            except socket.timeout:
                pass
            except OSError:
                closed_after = time.monotonic() - start
                break
    finally:
        sock.close()
    print(f"slow client cut off after {closed_after} s (timeout {TIMEOUT_S} s)")
    assert closed_after is not None and TIMEOUT_S - 0.1 <= closed_after <= TIMEOUT_S + 1.5
    assert admin.request("GET", "/status")[0] == 200  # the node goes on


@pytest.mark.parametrize(
    "raw",
    [
        b"\x16\x03\x01\x00\xff garbage\r\n\r\n",
        b"GET /status HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: -5\r\n\r\n",
        b"POST /erase HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET /lookup?keys=%ff%00&keys=2 HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n",
        b"GET /../../etc/passwd HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n",
        b"POST /erase HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 9\r\n\r\n[[[[[[[[[",
    ],
)
def test_garbage_requests_never_take_the_node_down(admin: Admin, raw: bytes) -> None:
    sock = socket.create_connection(("127.0.0.1", admin.port), timeout=10)
    try:
        sock.sendall(raw)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    except OSError:
        reply = b""
    finally:
        sock.close()
    assert not reply.startswith(b"HTTP/1.1 200") and not reply.startswith(b"HTTP/1.0 200")
    assert b"root:" not in reply
    assert admin.request("GET", "/status")[0] == 200


def test_tls(tmp_path: Path) -> None:
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
            + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key_file), "-out", str(cert)],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot make a test certificate with openssl: {err}")
    a = Admin(tmp_path, ["--max-size", "1MiB"], tls=(cert, key_file))
    try:
        assert a.url.startswith("https://")
        assert a.request("GET", "/status")[0] == 200
        assert a.request("GET", "/status", token="wrong-token-0123456789")[0] == 401
        plain = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)  # no TLS: no answer
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/status", headers={"Authorization": f"Bearer {TOKEN}"})
            plain.getresponse()
        plain.close()
    finally:
        a.stop()


def admin_cli(a: Admin, *args: str, token_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``lmcache-core admin`` against ``a``, as an operator runs it."""
    token = token_file or private_file(Path(tempfile.mkdtemp()) / "token", TOKEN + "\n")
    cmd = [sys.executable, "-m", "lmcache_core.cli", "admin", "--url", a.url, "--token-file", str(token), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_admin_command_speaks_to_the_api(admin: Admin) -> None:
    """``lmcache-core admin status | lookup | erase`` print the node's answers; a wrong
    token exits 1 with the node's refusal, a token file others can read exits 2
    before anything is sent (the API's refusal counter does not move)."""
    ns = os.urandom(16)
    keys = [key(ns, i) for i in range(3)]
    c = client(admin)
    for k in keys:
        assert c.put(k, frame(k))
    c.close()
    out = admin_cli(admin, "status")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tiers"][0]["chunks"] >= 3
    out = admin_cli(admin, "lookup", *(str(k) for k in keys))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["held"] == [True, True, True]
    out = admin_cli(admin, "erase", "--namespace", ns.hex(), "--dry-run")
    assert out.returncode == 0 and json.loads(out.stdout)["would_erase"] == 3, out.stdout + out.stderr
    out = admin_cli(admin, "erase", "--namespace", ns.hex())
    assert out.returncode == 0 and json.loads(out.stdout)["erased"] == 3, out.stdout + out.stderr
    out = admin_cli(admin, "lookup", *(str(k) for k in keys))
    assert json.loads(out.stdout)["held"] == [False, False, False]
    wrong = private_file(Path(tempfile.mkdtemp()) / "wrong", "x" * 40 + "\n")
    out = admin_cli(admin, "status", token_file=wrong)
    assert out.returncode == 1 and "401" in out.stderr, out.stderr
    _, before = admin.request("GET", "/status")
    loose = private_file(Path(tempfile.mkdtemp()) / "loose", TOKEN + "\n", mode=0o644)
    out = admin_cli(admin, "status", token_file=loose)
    assert out.returncode == 2 and "chmod 600" in out.stderr, out.stderr
    _, after = admin.request("GET", "/status")
    assert after["admin"]["unauthorized"] == before["admin"]["unauthorized"]


def test_the_openapi_description_is_served_in_the_docs_and_covers_every_route(admin: Admin) -> None:
    """GET /openapi.json answers the description; docs/backends/admin-openapi.json is the
    same text; every path and method it names is routed (not 404/405), and every route
    in the node's dispatcher is named in it (a route added without a description fails)."""
    from lmcache_backend_peer import admin as admin_module
    from lmcache_backend_peer.openapi import SPEC, text

    code, served = admin.request("GET", "/openapi.json")
    assert code == 200 and served == json.loads(json.dumps(SPEC))
    doc = Path(__file__).resolve().parents[2] / "docs" / "backends" / "admin-openapi.json"
    assert doc.read_text() == text(), "regenerate: python -m lmcache_backend_peer.openapi > docs/backends/admin-openapi.json"
    described = {(m.upper(), p) for p, ops in SPEC["paths"].items() for m in ops}
    routed = set(admin_module.ENDPOINTS)
    assert routed and routed == described, (routed, described)
    k = "v1-" + "00" * 16 + "-" + "11" * 16
    bodies = {"/erase": {"all": True, "dry_run": True}, "/retain": {"keys": [k], "seconds": 1}, "/release": {"keys": [k]}}
    for method, path in sorted(described - {("GET", "/metrics")}):  # /metrics is text: tests/deploy/test_node_metrics.py
        body = bodies.get(path)
        query = "?keys=" + k if path == "/lookup" else ""
        code, _ = admin.request(method, path + query, body)
        assert code == 200, (method, path, code)
    assert admin.request("GET", "/openapi.yaml")[0] == 404  # the control: an unknown path
    assert admin.request("POST", "/openapi.json", {})[0] == 405


@pytest.mark.parametrize(
    "reply",
    [
        b"garbage\r\n\r\n",  # no status line
        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"erased"',  # cut short
        b"HTTP/1.1 200 OK\r\nContent-Length: 20000\r\n\r\n" + b"[" * 10000 + b"]" * 10000,  # deeper than Python recurses
    ],
    ids=["not-http", "cut-short", "deep-json"],
)
def test_a_node_answering_garbage_is_a_backend_error_naming_it(tmp_path: Path, reply: bytes) -> None:
    """What lmcache-core erase meets through a peer tier's admin_urls: an answer that is
    not HTTP, is cut short or nests deeper than Python recurses is a BackendError naming
    the node (erase then reports that tier failed), never another exception."""
    from lmcache_backend_peer.admin_cli import NodeAdmins
    from lmcache_core.backend import BackendError, EraseMatch

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(0o600)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(BackendError, match=f"node admin API {url}"):
            NodeAdmins([url], token, None, timeout=5).erase(EraseMatch(None), dry_run=False)
    finally:
        t.join(timeout=5)
        listener.close()
