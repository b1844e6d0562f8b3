"""The peer tier over real loopback sockets: authentication, routing, connection
reuse, and misbehaving peers (silent, garbage, dying mid-transfer, corrupt data),
each of which must cost a miss within the timeout, never a hang or a crash."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from lmcache_backend_peer import FrameStore, PeerClient, PeerServer, create_peer_backend, serve_engine
from lmcache_backend_peer import protocol as p
from lmcache_backend_peer.auth import AuthError, server_handshake
from lmcache_backend_peer.backend import PeerBackend
from lmcache_backend_peer.connection import Connection
from lmcache_core import CacheEngine, KeyNamespace, load_config
from lmcache_core.serde import RawCodec, decode, encode
from lmcache_core.testing import make_context, random_chunk, random_key
from lmcache_core.testing.tokens import store_tokens, token_hashes

sys.path.insert(0, str(Path(__file__).parent))
from memtrace import peak_python_bytes  # noqa: E402

SECRET = b"network-test-secret-42"
HANG_BOUND = 10.0  # far above every timeout used here: only catches hangs


def addr(server: PeerServer) -> str:
    return f"{server.address[0]}:{server.address[1]}"


@pytest.fixture
def node() -> Iterator[PeerServer]:
    s = PeerServer(FrameStore(256 << 20), ("127.0.0.1", 0), SECRET, writable=True, timeout=2.0)
    yield s
    s.close()


def fill(server: PeerServer, n: int, shape: tuple[int, ...] = (4, 64)) -> list[tuple]:
    items = [(random_key(), random_chunk(shape=shape, seed=i)) for i in range(n)]
    for k, t in items:
        assert server.source.put_frame(k, encode(k, t, RawCodec()))
    return items


def client_backend(peers: list[str], secret: bytes = SECRET, **extra: object) -> PeerBackend:
    section = {"peers": peers, "secret": secret.decode(), "max_size": 0, "timeout_s": 0.3, **extra}
    b = create_peer_backend(section, make_context())
    assert isinstance(b, PeerBackend)
    return b


# -- a scriptable misbehaving server ----------------------------------------------------
class FakePeer:
    """Accepts connections and hands each to ``behave(sock)`` in a thread."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.behave = behave
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.accepted = 0
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                s, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self._open.append(s)
            threading.Thread(target=self._run, args=(s,), daemon=True).start()

    def _run(self, s: socket.socket) -> None:
        try:
            self.behave(s)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close()
        for s in self._open:
            s.close()


def _authed(s: socket.socket) -> Connection:
    conn = Connection(s, "fake")
    assert server_handshake(conn, SECRET, os.urandom(16), 5.0)
    return conn


def _read_request(conn: Connection) -> p.Header:
    header, _ = conn.recv(time.monotonic() + 5, 1 << 20)
    return header


def silent(s: socket.socket) -> None:
    time.sleep(3)


def garbage(s: socket.socket) -> None:
    s.sendall(os.urandom(4096))
    time.sleep(1)


def silent_after_auth(s: socket.socket) -> None:
    conn = _authed(s)
    _read_request(conn)
    time.sleep(3)


def dies_mid_transfer(s: socket.socket) -> None:
    conn = _authed(s)
    h = _read_request(conn)
    reply_type = p.LOOKUP_OK if h.type == p.LOOKUP else p.GET_OK
    body_len = 4 if h.type == p.LOOKUP else 1 << 20
    s.sendall(p.pack_header(reply_type, h.request_id, body_len) + b"\x00\x00")
    s.close()


def garbage_after_auth(s: socket.socket) -> None:
    conn = _authed(s)
    _read_request(conn)
    s.sendall(os.urandom(64))
    time.sleep(1)


def wrong_request_id(s: socket.socket) -> None:
    conn = _authed(s)
    h = _read_request(conn)
    conn.send(p.LOOKUP_OK, h.request_id + 1, [p.u32(1)], time.monotonic() + 5)
    time.sleep(1)


def lookup_claims_too_much(s: socket.socket) -> None:
    conn = _authed(s)
    h = _read_request(conn)
    conn.send(p.LOOKUP_OK, h.request_id, [p.u32(10**6)], time.monotonic() + 5)
    time.sleep(1)


def impostor(s: socket.socket) -> None:
    """Knows the protocol but not the secret: answers AUTH with a made-up proof."""
    conn = Connection(s, "impostor")
    conn.send(p.CHALLENGE, 0, [os.urandom(32), os.urandom(16)], time.monotonic() + 5)
    conn.recv(time.monotonic() + 5, 128)
    conn.send(p.AUTH_OK, 0, [os.urandom(32)], time.monotonic() + 5)
    time.sleep(1)


@pytest.mark.parametrize(
    "behave",
    [
        silent,
        garbage,
        silent_after_auth,
        dies_mid_transfer,
        garbage_after_auth,
        wrong_request_id,
        lookup_claims_too_much,
        impostor,
    ],
)
def test_misbehaving_peer_is_a_bounded_miss(behave: Callable[[socket.socket], None]) -> None:
    fake = FakePeer(behave)
    backend = client_backend([fake.address], retry_after_s=0.0)
    try:
        keys = [random_key() for _ in range(3)]
        out = torch.zeros(4, 64, dtype=torch.float16)
        t0 = time.monotonic()
        assert backend.contains(keys) == 0
        assert backend.get(keys[0], out) is False
        assert torch.count_nonzero(out) == 0
        assert time.monotonic() - t0 < HANG_BOUND
        assert backend.stats().errors >= 2
    finally:
        backend.close()
        fake.close()


def test_impostor_server_is_refused_by_the_client() -> None:
    fake = FakePeer(impostor)
    client = PeerClient(("127.0.0.1", int(fake.address.split(":")[1])), SECRET, timeout=2.0)
    try:
        with pytest.raises(AuthError, match="failed to prove"):
            client.lookup([random_key()])
    finally:
        client.close()
        fake.close()


def test_unreachable_peer_is_a_miss_and_then_skipped() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    fake = FakePeer(silent)
    backend = client_backend([f"127.0.0.1:{port}", fake.address], retry_after_s=60.0)
    try:
        assert backend.contains([random_key()]) == 0
        assert fake.accepted == 1
        assert backend.stats().extra["peers"] == {f"127.0.0.1:{port}": "down", fake.address: "down"}
        assert backend.contains([random_key()]) == 0
        assert fake.accepted == 1  # skipped while down: no new connection, no new timeout
    finally:
        backend.close()
        fake.close()


# -- authentication ------------------------------------------------------------------------
def test_wrong_secret_reads_nothing(node: PeerServer) -> None:
    items = fill(node, 3)
    keys = [k for k, _ in items]
    bad = client_backend([addr(node)], secret=b"not-the-secret-0123456789")
    good = client_backend([addr(node)])
    try:
        out = torch.zeros(4, 64, dtype=torch.float16)
        assert bad.contains(keys) == 0
        assert bad.get(keys[0], out) is False and torch.count_nonzero(out) == 0
        deadline = time.monotonic() + 5  # the server counts the failure on its own thread
        while node.stats["auth_failures"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert node.stats["auth_failures"] >= 1
        assert good.contains(keys) == 3
        assert good.get(keys[0], out) and torch.equal(out, items[0][1])
    finally:
        bad.close()
        good.close()


def test_wrong_secret_put_stores_nothing(node: PeerServer) -> None:
    bad = client_backend([addr(node)], secret=b"not-the-secret-0123456789", push=True)
    try:
        key = random_key()
        assert bad.put(key, random_chunk(shape=(4, 64))) is False
        assert bad.remove(key) is False
    finally:
        bad.close()
    assert len(node.source) == 0


def test_requests_before_authentication_are_not_served(node: PeerServer) -> None:
    """A client that skips the handshake and sends PUT/GET gets no data and stores nothing."""
    items = fill(node, 1)
    key = random_key()
    frame = encode(key, random_chunk(shape=(2, 2)), RawCodec())
    received = b""
    with socket.create_connection(node.address, timeout=2) as s:
        try:
            s.sendall(p.encode_message(p.PUT, 1, [p.key_bytes(key), frame]))
            s.sendall(p.encode_message(p.GET, 2, [p.encode_keys([items[0][0]])]))
        except OSError:
            pass  # the server hung up on us: fine
        s.settimeout(3)
        try:
            while chunk := s.recv(65536):
                received += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    assert node.source.contains([key]) == 0
    assert len(node.source) == 1
    assert bytes(node.source.get_frame(items[0][0])) not in received
    assert len(received) < 200  # the challenge and an error at most


# -- data path -------------------------------------------------------------------------------
def test_corrupt_or_misrouted_frames_are_misses() -> None:
    k_bad, k_other, k_ok = random_key(), random_key(), random_key()
    data = random_chunk(shape=(4, 64))
    good = encode(k_ok, data, RawCodec())
    corrupt = bytearray(encode(k_bad, data, RawCodec()))
    corrupt[-3] ^= 0xFF

    class Source:
        def contains(self, keys):
            return len(keys)

        def get_frame(self, key):
            return {k_bad: bytes(corrupt), k_other: good, k_ok: good}.get(key)

    server = PeerServer(Source(), ("127.0.0.1", 0), SECRET)
    backend = client_backend([addr(server)])
    try:
        out = torch.zeros_like(data)
        assert backend.get(k_bad, out) is False
        assert backend.get(k_other, out) is False  # a frame for another key is never data
        assert backend.get(k_ok, torch.zeros(8, 32, dtype=torch.float16)) is False  # wrong shape
        assert backend.get(k_ok, out) and torch.equal(out, data)
        assert backend.stats().errors == 3
    finally:
        backend.close()
        server.close()


def test_source_failure_answers_error_and_keeps_the_connection() -> None:
    class Broken:
        def contains(self, keys):
            raise RuntimeError("disk on fire")

        def get_frame(self, key):
            return None

    server = PeerServer(Broken(), ("127.0.0.1", 0), SECRET)
    client = PeerClient(server.address, SECRET, timeout=2.0)
    try:
        from lmcache_backend_peer import PeerRequestError

        with pytest.raises(PeerRequestError, match="RuntimeError"):
            client.lookup([random_key()])
        assert client.get([random_key()]) == [None]
        assert server.stats["connections"] == 1
    finally:
        client.close()
        server.close()


def test_connections_are_reused(node: PeerServer) -> None:
    items = fill(node, 4)
    backend = client_backend([addr(node)])
    try:
        for _ in range(20):
            assert backend.contains([k for k, _ in items]) == 4
            out = torch.empty_like(items[1][1])
            assert backend.get(items[1][0], out) and torch.equal(out, items[1][1])
        assert node.stats["connections"] == 1
        assert node.stats["requests"] == 40
    finally:
        backend.close()


def test_reconnects_after_the_server_drops_idle_connections() -> None:
    store = FrameStore(1 << 20)
    server = PeerServer(store, ("127.0.0.1", 0), SECRET, idle_timeout=0.2)
    items = [(random_key(), random_chunk(shape=(2, 8))) for _ in range(1)]
    store.put_frame(items[0][0], encode(items[0][0], items[0][1], RawCodec()))
    client = PeerClient(server.address, SECRET, timeout=2.0)
    try:
        assert client.lookup([items[0][0]]) == 1
        time.sleep(0.6)  # the server has closed our pooled connection by now
        assert client.lookup([items[0][0]]) == 1
        assert server.stats["connections"] == 2
    finally:
        client.close()
        server.close()


def test_get_replies_respect_the_frame_size_limit() -> None:
    store = FrameStore(64 << 20)
    server = PeerServer(store, ("127.0.0.1", 0), SECRET, max_frame_size=64 << 10)
    items = [(random_key(), random_chunk(shape=(64, 64), seed=i)) for i in range(10)]  # 8 KiB each
    big = random_key()
    for k, t in items:
        store.put_frame(k, encode(k, t, RawCodec()))
    store.put_frame(big, encode(big, random_chunk(shape=(256, 256)), RawCodec()))  # 128 KiB
    client = PeerClient(server.address, SECRET, timeout=2.0)
    try:
        frames = client.get([k for k, _ in items] + [big])
        assert len(frames) == 11 and frames[-1] is None
        for (k, t), f in zip(items, frames):
            assert torch.equal(decode(f, {"raw": RawCodec()}, expect_key=k), t)
        assert server.stats["requests"] >= 2
    finally:
        client.close()
        server.close()


def test_oversized_request_closes_the_connection(node: PeerServer) -> None:
    client = PeerClient(node.address, SECRET, timeout=2.0, max_frame_size=1 << 30)
    node.max_frame_size = 1024
    try:
        with pytest.raises(p.PeerError):
            client.put(random_key(), b"x" * 4096)
        assert len(node.source) == 0
    finally:
        client.close()


def test_contains_combines_peers_and_routes_gets() -> None:
    a = PeerServer(FrameStore(1 << 24), ("127.0.0.1", 0), SECRET)
    b = PeerServer(FrameStore(1 << 24), ("127.0.0.1", 0), SECRET)
    chunks = [(random_key(), random_chunk(shape=(4, 64), seed=i)) for i in range(6)]
    for i, (k, t) in enumerate(chunks):
        (a if i < 3 else b).source.put_frame(k, encode(k, t, RawCodec()))
    backend = client_backend([addr(a), addr(b)])
    try:
        keys = [k for k, _ in chunks]
        assert backend.contains(keys) == 6
        before_a = a.stats["requests"]
        out = torch.empty(4, 64, dtype=torch.float16)
        for k, t in chunks[3:]:
            assert backend.get(k, out) and torch.equal(out, t)
        assert a.stats["requests"] == before_a  # routed straight to b
        assert backend.contains([random_key()] + keys) == 0
        outs = [torch.empty(4, 64, dtype=torch.float16) for _ in chunks]
        assert backend.get_many(keys, outs) == [True] * 6
        assert all(torch.equal(o, t) for o, (_, t) in zip(outs, chunks))
    finally:
        backend.close()
        a.close()
        b.close()


def test_a_peer_never_asks_itself() -> None:
    ctx = make_context()
    me = create_peer_backend({"listen": "127.0.0.1:0", "secret": SECRET.decode()}, ctx)
    assert isinstance(me, PeerBackend) and me.server is not None
    selfish = PeerBackend(
        me.store,
        [PeerClient(me.server.address, SECRET, timeout=1.0)],
        codec=RawCodec(),
        codecs={"raw": RawCodec()},
        server=me.server,
    )
    try:
        assert selfish.contains([random_key()]) == 0
        assert selfish.stats().extra["peers"] == {addr(me.server): "self"}
        requests = me.server.stats["requests"]
        selfish.contains([random_key()])
        assert me.server.stats["requests"] == requests
    finally:
        selfish.close()
        me.close()


def test_serve_engine_serves_the_cpu_tier() -> None:
    engine = CacheEngine(load_config(overrides={"chunk_size": 16}), namespace=KeyNamespace(model="m"))
    tokens = list(range(64))
    chunks = [random_chunk(shape=(2, 16, 8), seed=i) for i in range(4)]
    assert store_tokens(engine, tokens, chunks) == 4
    server = serve_engine(engine, ("127.0.0.1", 0), SECRET)
    backend = client_backend([addr(server)])
    try:
        keys = engine.keys(token_hashes(engine, tokens))
        assert backend.contains(keys) == 4
        for k, c in zip(keys, chunks):
            out = torch.empty_like(c)
            assert backend.get(k, out) and torch.equal(out, c)
        client = PeerClient(server.address, SECRET, timeout=1.0)
        with pytest.raises(p.PeerError, match="read-only"):
            client.put(keys[0], encode(keys[0], chunks[0], RawCodec()))
        client.close()
    finally:
        backend.close()
        server.close()
        engine.close()


# -- pipelined batch reads --------------------------------------------------------------------
def _fetch_all(client: PeerClient, keys: list, sizes: list[int] | None) -> dict[int, bytes | None]:
    """Every frame fetch hands over, by index; a key handed over twice fails the test."""
    seen: dict[int, bytes | None] = {}

    def sink(i: int, f: memoryview | None) -> None:
        assert i not in seen, f"key {i} handed over twice"
        seen[i] = None if f is None else bytes(f)

    assert client.fetch(keys, sink, sizes) == len(keys)
    return seen


def test_a_pipelined_fetch_survives_replies_the_server_cuts_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """With sizes, fetch sends GETs of about FETCH_REPLY_BYTES each, two in flight. A
    server whose replies are capped lower answers part of each; the rest of every
    group is fetched afterwards, each key handed over once, in its own slot."""
    from lmcache_backend_peer import client as peer_client

    monkeypatch.setattr(peer_client, "FETCH_REPLY_BYTES", 200 << 10)  # groups of ~24 frames of 8 KiB
    store = FrameStore(64 << 20)
    server = PeerServer(store, ("127.0.0.1", 0), SECRET, max_frame_size=64 << 10)  # replies of at most 7 frames
    items = [(random_key(), random_chunk(shape=(64, 64), seed=i)) for i in range(60)]
    for k, t in items[:-1]:  # the last one is a miss
        store.put_frame(k, encode(k, t, RawCodec()))
    client = PeerClient(server.address, SECRET, timeout=2.0)
    try:
        keys = [k for k, _ in items]
        got = _fetch_all(client, keys, [t.nbytes for _, t in items])
        assert sorted(got) == list(range(60)) and got[59] is None
        for i, (k, t) in enumerate(items[:-1]):
            assert torch.equal(decode(got[i], {"raw": RawCodec()}, expect_key=k), t), i
        assert server.stats["requests"] >= 60 // 7  # the cut-off rests were asked for: replies of <= 7 frames
        assert server.stats["connections"] == 1  # and on the same pooled connection
    finally:
        client.close()
        server.close()


def test_a_pipelined_fetch_retries_once_on_a_pooled_connection_the_server_dropped() -> None:
    store = FrameStore(32 << 20)
    server = PeerServer(store, ("127.0.0.1", 0), SECRET, idle_timeout=0.2)
    items = [(random_key(), random_chunk(shape=(512, 1024), seed=i)) for i in range(20)]  # 1 MiB each
    for k, t in items:
        store.put_frame(k, encode(k, t, RawCodec()))
    client = PeerClient(server.address, SECRET, timeout=2.0)
    try:
        assert client.lookup([items[0][0]]) == 1  # pools a connection
        time.sleep(0.6)  # the server has closed it by now
        got = _fetch_all(client, [k for k, _ in items], [t.nbytes for _, t in items])
        assert all(torch.equal(decode(got[i], {"raw": RawCodec()}, expect_key=k), t) for i, (k, t) in enumerate(items))
        assert server.stats["connections"] == 2
    finally:
        client.close()
        server.close()


def test_a_large_batch_read_reuses_one_reply_buffer(node: PeerServer) -> None:
    """80 chunks of 1 MiB (more than a connection keeps a buffer for) come in as
    pipelined GETs of ~16 MiB into the connection's reused buffer: a repeated read
    allocates almost no Python memory (it used to take one fresh 80 MiB reply)."""
    items = fill(node, 80, shape=(512, 1024))
    backend = client_backend([addr(node)], timeout_s=5.0)
    try:
        keys = [k for k, _ in items]
        outs = [torch.empty_like(t) for _, t in items]
        assert backend.get_many(keys, outs) == [True] * 80  # warms the connection's buffer
        hits, peak = peak_python_bytes(lambda: backend.get_many(keys, outs))
        assert hits == [True] * 80 and all(torch.equal(o, t) for o, (_, t) in zip(outs, items))
        assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB of Python memory for an 80 MiB read"
    finally:
        backend.close()
