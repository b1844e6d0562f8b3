"""A peer cache node under hostile clients (a real ``lmcache-core serve`` in a child
process, 127.0.0.1 only):

* a flood of a few hundred idle sockets from clients without the secret
  never starves authenticated clients (their own budget, per-address cap, short
  handshake deadline). Negative control: with the per-address cap as large as the
  whole budget (and the old handshake deadline), the same flood starves fresh
  connections.
* clients that announce large PUT bodies and stall cannot push the node's RSS past
  its in-flight budget; the surplus is refused "busy".
* tenants on a shared node: a chunk written without a tenant's key is never its hit,
  a tenant name with another tenant's secret is refused, instances of one tenant
  serve each other and nobody else, and a bad tenants file is refused naming the line.

Flood sources use other loopback addresses (127.0.0.2, ...) to stand for other hosts.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_node import PeerNode  # noqa: E402

from lmcache_backend_peer import PeerClient, create_peer_backend  # noqa: E402
from lmcache_backend_peer import protocol as p  # noqa: E402
from lmcache_backend_peer.auth import client_handshake  # noqa: E402
from lmcache_backend_peer.backend import PeerBackend  # noqa: E402
from lmcache_backend_peer.connection import Connection  # noqa: E402
from lmcache_core.serde import RawCodec, encode  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

SECRET = "hardening-test-secret-0123456789abcdef"
FLOOD_SOCKETS = 300
WINDOW_S = 2.0
MiB = 1 << 20
VICTIM, MALLORY = "t-victim", "t-mallory"
VICTIM_SECRET, MALLORY_SECRET = "victim-secret-9f8e7d6c5b4a3210", "mallory-secret-0a1b2c3d4e5f6789"
# One node for most tests (each start costs an interpreter with torch): the exposure
# limits under test, a 64 MiB in-flight budget, a shared secret and two tenants.
NODE_OPTIONS = [
    "--max-size",
    "64MiB",
    "--max-frame-size",
    "64MiB",
    "--max-inflight",
    "64MiB",
    "--timeout-s",
    "2",
    "--max-unauthenticated",
    "32",
    "--max-unauthenticated-per-address",
    "4",
    "--handshake-timeout-s",
    "0.5",
]


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    f = tmp_path / "peer.secret"
    f.write_text(SECRET + "\n")
    return f


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerNode]:
    d = tmp_path_factory.mktemp("node")
    (d / "peer.secret").write_text(SECRET + "\n")
    (d / "tenants").write_text(f"# name secret\n{VICTIM} {VICTIM_SECRET}\n{MALLORY} {MALLORY_SECRET}\n")
    node = PeerNode([*NODE_OPTIONS, "--tenants-file", str(d / "tenants")], d / "peer.secret")
    yield node
    node.stop()


def port_of(node: PeerNode) -> tuple[str, int]:
    return ("127.0.0.1", node.port)


class Flood:
    """Keeps ``n`` idle TCP connections open to ``target`` from ``sources`` (round
    robin), replacing the oldest 20 every 50 ms; never sends a byte. Bounded: stops
    at ``stop()`` or after ``max_s``."""

    def __init__(self, target: tuple[str, int], sources: list[str], n: int = FLOOD_SOCKETS, max_s: float = 20.0) -> None:
        self.target, self.sources, self.n, self.max_s = target, sources, n, max_s
        self.opened = 0
        self._stop = threading.Event()
        self._socks: deque[socket.socket] = deque()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        s = socket.socket()
        s.bind((self.sources[self.opened % len(self.sources)], 0))
        s.settimeout(1.0)
        try:
            s.connect(self.target)
        except OSError:
            s.close()
            return
        self.opened += 1
        self._socks.append(s)

    def _run(self) -> None:
        end = time.monotonic() + self.max_s
        while len(self._socks) < self.n and not self._stop.is_set():
            self._open()
        while not self._stop.is_set() and time.monotonic() < end:
            for _ in range(20):
                self._socks.popleft().close()
                self._open()
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        while self._socks:
            self._socks.popleft().close()


def fresh_lookups(address: tuple[str, int], keys: list, seconds: float) -> tuple[int, int]:
    """(succeeded, attempted) lookups, each on a new connection (connect +
    handshake + LOOKUP), for ``seconds``."""
    ok = tried = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and tried < 200:
        client = PeerClient(address, SECRET.encode(), timeout=1.0, connect_timeout=0.5, pool_size=0)
        tried += 1
        try:
            ok += client.lookup(keys) == len(keys)
        except p.PeerError:
            pass
        finally:
            client.close()
        time.sleep(0.02)
    return ok, tried


def pooled_lookups(backend: PeerBackend, keys: list, seconds: float) -> tuple[int, int]:
    ok = tried = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and tried < 500:
        tried += 1
        ok += backend.contains(keys) == len(keys)
        time.sleep(0.01)
    return ok, tried


@pytest.fixture
def guarded_node(shared_node: PeerNode) -> PeerNode:
    return shared_node


def stored_keys(node: PeerNode, n: int = 4) -> list:
    client = PeerClient(port_of(node), SECRET.encode(), timeout=5.0)
    keys = [random_key() for _ in range(n)]
    for i, k in enumerate(keys):
        assert client.put(k, encode(k, random_chunk(shape=(8, 64), seed=i), RawCodec()))
    client.close()
    return keys


def test_flood_from_one_host_never_starves_fresh_authenticated_connections(guarded_node: PeerNode) -> None:
    keys = stored_keys(guarded_node)
    flood = Flood(port_of(guarded_node), ["127.0.0.2"])
    try:
        time.sleep(0.5)
        ok, tried = fresh_lookups(port_of(guarded_node), keys, WINDOW_S)
    finally:
        flood.stop()
    print(f"one-host flood ({flood.opened} sockets): fresh lookups {ok}/{tried}")
    assert flood.opened >= FLOOD_SOCKETS
    assert tried >= 30 and ok / tried >= 0.99, (ok, tried)


def test_flood_from_many_hosts_never_starves_pooled_authenticated_clients(guarded_node: PeerNode) -> None:
    keys = stored_keys(guarded_node)
    section = {"peers": [guarded_node.address], "secret": SECRET, "max_size": 0, "timeout_s": 2.0, "retry_after_s": 0.0}
    backend = create_peer_backend(section, make_context())
    assert isinstance(backend, PeerBackend)
    try:
        assert backend.contains(keys) == len(keys)  # warm: an authenticated pooled connection
        flood = Flood(port_of(guarded_node), [f"127.0.0.{i}" for i in range(2, 102)])
        try:
            time.sleep(0.5)
            ok, tried = pooled_lookups(backend, keys, WINDOW_S)
        finally:
            flood.stop()
        print(f"many-host flood ({flood.opened} sockets): pooled lookups {ok}/{tried}")
        assert flood.opened >= FLOOD_SOCKETS
        assert tried >= 50 and ok / tried >= 0.99, (ok, tried)
    finally:
        backend.close()


def test_negative_control_without_a_per_address_cap_the_flood_starves_new_connections(secret_file: Path) -> None:
    """The old admission: no per-address cap, handshakes allowed the request timeout.
    The flood comes from the client's own address here, so that admission cannot tell
    the two apart either (per-address and per-subnet caps and fair-share eviction all
    count addresses): the same flood then starves fresh connections."""
    node = PeerNode(
        [
            "--max-size",
            "64MiB",
            "--max-unauthenticated",
            "32",
            "--max-unauthenticated-per-address",
            "32",
            "--max-unauthenticated-per-subnet",
            "32",
            "--handshake-timeout-s",
            "3",
        ],
        secret_file,
    )
    try:
        keys = stored_keys(node)
        flood = Flood(port_of(node), ["127.0.0.1"])
        try:
            time.sleep(0.5)
            ok, tried = fresh_lookups(port_of(node), keys, WINDOW_S)
        finally:
            flood.stop()
        print(f"control, no per-address cap: fresh lookups {ok}/{tried}")
        assert tried >= 10 and ok / tried < 0.5, (ok, tried)
    finally:
        node.stop()


# -- bytes in flight -------------------------------------------------------------------------
def stalled_put(address: tuple[str, int], body_len: int, sent: int) -> socket.socket:
    """Authenticate, announce a PUT of ``body_len`` bytes, send ``sent`` of them, stall."""
    sock = socket.create_connection(address, timeout=5)
    conn = Connection(sock, "staller")
    client_handshake(conn, SECRET.encode(), time.monotonic() + 5)
    sock.sendall(p.pack_header(p.PUT, 1, body_len) + b"\0" * sent)
    return sock


def test_stalled_puts_cannot_push_the_node_past_its_inflight_budget(shared_node: PeerNode) -> None:
    budget, body, n = 64 * MiB, 60 * MiB, 6
    node = shared_node
    socks: list[socket.socket] = []
    try:
        keys = stored_keys(node)
        base = node.rss()
        socks = [stalled_put(port_of(node), body, MiB) for _ in range(n)]
        peak = base
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            peak = max(peak, node.rss())
            time.sleep(0.1)
        # A small authenticated request still goes through meanwhile.
        assert PeerClient(port_of(node), SECRET.encode(), timeout=2.0, pool_size=0).lookup(keys) == len(keys)
        grown = peak - base
        print(
            f"stalled PUTs: node RSS grew {grown / MiB:.1f} MiB (budget {budget // MiB} MiB, {n} x {body // MiB} MiB announced)"
        )
        # One stalled body was admitted (the probe does see allocations), never six.
        assert 40 * MiB <= grown <= budget + 24 * MiB, f"RSS grew {grown / MiB:.0f} MiB (6 x 60 MiB without the budget)"
        # The others were told the node is busy after waiting up to --timeout-s for room
        # (one may get in when the first stalled body reaches its deadline and is dropped).
        busy = 0
        for s in socks:
            s.settimeout(5)
            try:
                head = s.recv(p.HEADER_SIZE)
                if len(head) == p.HEADER_SIZE and p.decode_header(head, 1 << 20).type == p.ERROR:
                    busy += b"busy" in s.recv(1024)
            except OSError:
                pass
        print(f"stalled PUTs refused busy: {busy}/{n}")
        assert busy >= n - 2, busy
    finally:
        for s in socks:
            s.close()


def test_read_only_tier_server_steps_over_a_put_body_without_holding_it() -> None:
    section = {"listen": "127.0.0.1:0", "secret": SECRET, "max_size": "8MiB"}
    b = create_peer_backend(section, make_context())
    assert isinstance(b, PeerBackend) and b.server is not None
    try:
        k = random_key()
        assert b.put(k, random_chunk(shape=(8, 64), seed=9))
        s = stalled_put(b.server.address, 32 * MiB, 32 * MiB)  # the whole body, sent
        conn = Connection(s, "reader")
        header, body = conn.recv(time.monotonic() + 5, 1 << 20)
        assert header.type == p.ERROR and b"read-only" in bytes(body)
        assert b.server.inflight.peak == 0  # nothing was reserved, let alone allocated whole
        # The connection stays in step: the next request on it is answered.
        conn.send(p.LOOKUP, 2, [p.encode_keys([k])], time.monotonic() + 5)
        header, body = conn.recv(time.monotonic() + 5, 1 << 20)
        assert header.type == p.LOOKUP_OK and p.parse_body(header.type, body) == p.Count(1)
        conn.close()
    finally:
        b.close()


# -- tenants on a shared node ------------------------------------------------------------------
N_FORGED = 16


@pytest.fixture
def tenant_node(shared_node: PeerNode) -> PeerNode:
    return shared_node


def tier(node: PeerNode, secret: str, tenant: str | None = None) -> PeerBackend:
    section = {
        "peers": [node.address],
        "secret": secret,
        "push": True,
        "max_size": 0,
        "timeout_s": 2.0,
        "retry_after_s": 0.0,
        **({"tenant": tenant} if tenant else {}),
    }
    b = create_peer_backend(section, make_context())
    assert isinstance(b, PeerBackend)
    return b


def test_a_chunk_written_without_the_tenants_key_is_never_its_hit(tenant_node: PeerNode) -> None:
    import torch

    victim, mallory, shared = (
        tier(tenant_node, VICTIM_SECRET, VICTIM),
        tier(tenant_node, MALLORY_SECRET, MALLORY),
        tier(tenant_node, SECRET),
    )
    try:
        own = random_key()
        genuine = random_chunk(shape=(8, 64), seed=1)
        assert victim.put(own, genuine)
        forged_keys = [random_key() for _ in range(N_FORGED)]
        forged = random_chunk(shape=(8, 64), seed=666)
        # Another tenant and a holder of the node's shared secret both write valid frames
        # under the victim's keys, and try to overwrite the victim's existing chunk.
        for i, k in enumerate(forged_keys):
            assert (mallory if i % 2 else shared).put(k, forged)
        assert mallory.put(own, forged) and shared.put(own, forged)
        out = torch.zeros_like(forged)
        hits = sum(victim.get(k, out) for k in forged_keys)
        print(f"tenant isolation: forged chunks served to the victim as hits: {hits}/{N_FORGED}")
        assert hits == 0 and victim.contains(forged_keys) == 0
        assert victim.get(own, out) and torch.equal(out, genuine)  # its own chunk, untouched
        # Control: the forgers do read back what they wrote (the frames are valid hits
        # in their own namespaces), and a shared-secret reader is one trust domain.
        assert mallory.get(forged_keys[1], out) and torch.equal(out, forged)
        assert shared.get(forged_keys[0], out) and torch.equal(out, forged)
        assert mallory.get(own, out) and torch.equal(out, forged)
    finally:
        for b in (victim, mallory, shared):
            b.close()


def test_a_tenant_name_with_another_tenants_secret_is_refused(tenant_node: PeerNode) -> None:
    from lmcache_backend_peer.auth import AuthError

    for name, secret in ((VICTIM, MALLORY_SECRET), (VICTIM, SECRET), ("t-nobody", MALLORY_SECRET)):
        client = PeerClient(port_of(tenant_node), secret.encode(), timeout=2.0, tenant=name)
        try:
            with pytest.raises(AuthError):
                client.lookup([random_key()])
        finally:
            client.close()


def test_tenants_file_errors_name_the_line(tmp_path: Path) -> None:
    from lmcache_backend_peer.tenants import load_tenants

    tf = tmp_path / "tenants"
    for text, match in (
        (f"{VICTIM} short\n", r":1: tenant 't-victim'.*at least 16"),
        (f"{VICTIM} {VICTIM_SECRET}\n{VICTIM} {MALLORY_SECRET}\n", ":2: tenant 't-victim' is listed twice"),
        ("bad/name x\n", ":1: tenant name"),
        ("# nothing\n", "no tenants"),
    ):
        tf.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_tenants(tf)


def test_instances_of_one_tenant_serve_each_other_and_nobody_else() -> None:
    import torch

    a = create_peer_backend(
        {"listen": "127.0.0.1:0", "secret": VICTIM_SECRET, "tenant": VICTIM, "max_size": "8MiB"}, make_context()
    )
    assert isinstance(a, PeerBackend) and a.server is not None
    host, port = a.server.address
    k, data = random_key(), random_chunk(shape=(8, 64), seed=5)
    assert a.put(k, data)
    b = create_peer_backend(
        {"peers": [f"{host}:{port}"], "secret": VICTIM_SECRET, "tenant": VICTIM, "max_size": 0}, make_context()
    )
    c = create_peer_backend({"peers": [f"{host}:{port}"], "secret": VICTIM_SECRET, "max_size": 0}, make_context())
    try:
        out = torch.zeros_like(data)
        assert b.get(k, out) and torch.equal(out, data)
        assert c.contains([k]) == 0 and not c.get(k, out)  # right secret, but not as the tenant
    finally:
        for x in (a, b, c):
            x.close()


def test_node_with_only_a_tenants_file_has_no_shared_secret_and_rejects_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_backend_peer import cli
    from lmcache_backend_peer.auth import AuthError

    tf = tmp_path / "tenants"
    tf.write_text(f"{VICTIM} {VICTIM_SECRET}\n")
    node = PeerNode(["--max-size", "8MiB", "--tenants-file", str(tf)])
    try:
        victim = PeerClient(port_of(node), VICTIM_SECRET.encode(), timeout=2.0, tenant=VICTIM)
        assert victim.lookup([random_key()]) == 0
        victim.close()
        # Nobody holds a shared secret: even the tenant's secret without the name is refused.
        untenanted = PeerClient(port_of(node), VICTIM_SECRET.encode(), timeout=2.0)
        with pytest.raises(AuthError):
            untenanted.lookup([random_key()])
        untenanted.close()
    finally:
        node.stop()
    tf.write_text(f"{VICTIM} short\n")
    monkeypatch.delenv("LMCACHE_PEER_SECRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--listen", "127.0.0.1:0", "--tenants-file", str(tf)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--tenants-file: {tf}:1: tenant 't-victim'" in err and "at least 16" in err, err
