"""What a cache node drops reaches the engines that pushed there (KV events for routers).

A real node (``lmcache-core serve`` in a child process, on loopback and on its Unix
socket with shared memory) with a budget of a few frames takes pushes from a real
engine; the engine's listener must see ``evicted`` for exactly the keys the node no
longer holds (asked of the node itself), never for a key it still holds, within a
bounded time. Tenants read only their own drops; a restarted node is noticed; a node
without an eviction log turns the polling off. The wire messages are bounded and a
hostile reply is a :class:`ProtocolError`.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from lmcache_backend_peer import PeerClient, ProtocolError
from lmcache_backend_peer import protocol as p
from lmcache_backend_peer.evictions import EvictionLog
from lmcache_backend_peer.shm import SHM_SUPPORTED, SLOT_HEADER, _align
from lmcache_backend_peer.store import FrameStore
from lmcache_core import CacheEngine, KeyNamespace, load_config
from lmcache_core.engine import TierEvent
from lmcache_core.keys import ChunkKey
from lmcache_core.serde import RawCodec, encode
from lmcache_core.testing.tokens import store_tokens, token_hashes

from peer_node import PeerNode

CHUNK = 16
SHAPE = (2, CHUNK, 8)
SECRET = "evictions-test-secret-0xBEEF"
POLL_S = 0.05
WAIT_S = 15.0


def tokens_for(seed: int, n_chunks: int) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(n_chunks * CHUNK)]


def chunks_for(seed: int, n_chunks: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(torch.float16) for _ in range(n_chunks)]


def frame_len() -> int:
    key = ChunkKey(b"\x01" * 16, b"\x02" * 16)
    return len(encode(key, torch.zeros(SHAPE, dtype=torch.float16), RawCodec()))


class Recorder:
    def __init__(self) -> None:
        self.evicted: list[ChunkKey] = []

    def __call__(self, ev: TierEvent) -> None:
        if ev.kind == "evicted" and ev.tier == "peer":
            self.evicted.append(ev.key)


def engine(peer: dict[str, Any]) -> tuple[CacheEngine, Recorder]:
    cfg = load_config(
        overrides={
            "chunk_size": CHUNK,
            "backends": [
                {"name": "local_cpu", "max_size": "16MiB"},
                {"name": "peer", "max_size": 0, "push": True, "timeout_s": 2.0, "eviction_poll_s": POLL_S, **peer},
            ],
        }
    )
    eng = CacheEngine(cfg, namespace=KeyNamespace(model="m"))
    rec = Recorder()
    eng.add_listener(rec)
    return eng, rec


def store(eng: CacheEngine, seed: int, n: int) -> list[ChunkKey]:
    tokens = tokens_for(seed, n)
    assert store_tokens(eng, tokens, chunks_for(seed, n)) == n
    assert eng.flush(30)
    return list(eng.keys(token_hashes(eng, tokens)))


def held(client: PeerClient, keys: list[ChunkKey]) -> set[ChunkKey]:
    return {k for k in keys if client.lookup([k]) == 1}


def wait_for(rec: Recorder, want: set[ChunkKey]) -> None:
    deadline = time.monotonic() + WAIT_S
    while set(rec.evicted) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(rec.evicted) == want


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    f = tmp_path / "peer.secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    return f


@pytest.fixture(params=["tcp", "unix-shm"])
def node(request: pytest.FixtureRequest, secret_file: Path, tmp_path: Path) -> Iterator[tuple[PeerNode, dict[str, Any]]]:
    """A node that holds 3 frames, and the peer section that pushes to it."""
    if request.param == "tcp":
        n = PeerNode(["--max-size", str(3 * frame_len() + frame_len() // 2)], secret_file)
        section: dict[str, Any] = {"peers": [n.address]}
    else:
        if not SHM_SUPPORTED:
            pytest.skip("no shared-memory fast path on this host")
        sock = tmp_path / "node.sock"
        n = PeerNode(["--max-size", str(3 * _align(SLOT_HEADER + frame_len()) + 32), "--unix-socket", str(sock)], secret_file)
        section = {"unix_socket": str(sock)}
    try:
        yield n, {**section, "secret_file": str(secret_file)}
    finally:
        n.stop()


def client_for(n: PeerNode, secret: str = SECRET, tenant: str | None = None) -> PeerClient:
    return PeerClient(("127.0.0.1", n.port), secret.encode(), timeout=2.0, tenant=tenant)


def test_node_drops_reach_the_engine_exactly(node: tuple[PeerNode, dict[str, Any]]) -> None:
    n, section = node
    eng, rec = engine(section)
    check = client_for(n)
    try:
        keys = store(eng, 1, 6)
        still = held(check, keys)
        assert len(still) == 3  # the budget holds three frames: three went
        wait_for(rec, set(keys) - still)
        time.sleep(10 * POLL_S)  # negative control: keys still held are never reported
        assert not set(rec.evicted) & still
        assert held(check, keys) == still

        # A REMOVE by another client is a drop too; the engine hears of it.
        gone = sorted(still, key=lambda k: k.chunk_hash)[0]
        assert check.remove([gone]) == 1
        wait_for(rec, set(keys) - still | {gone})
        assert eng.tiers[1].stats().extra["node_drops_reported"] == 4
    finally:
        check.close()
        eng.close()


def test_tenants_read_only_their_own_drops(secret_file: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants"
    tenants.write_text("alice alice-secret-0123456789\nbob bob-secret-0123456789abc\n")
    n = PeerNode(["--max-size", str(3 * frame_len() + frame_len() // 2), "--tenants-file", str(tenants)])
    bob, bob_rec = engine({"peers": [n.address], "secret": "bob-secret-0123456789abc", "tenant": "bob"})
    alice, alice_rec = engine({"peers": [n.address], "secret": "alice-secret-0123456789", "tenant": "alice"})
    a_check = client_for(n, "alice-secret-0123456789", "alice")
    b_check = client_for(n, "bob-secret-0123456789abc", "bob")
    try:
        b_keys = store(bob, 2, 1)
        time.sleep(5 * POLL_S)  # bob's first poll has learned the node's head
        a_keys = store(alice, 3, 6)  # the node's LRU is shared: bob's chunk goes too
        assert held(b_check, b_keys) == set()
        a_held = held(a_check, a_keys)
        assert len(a_held) == 3
        wait_for(bob_rec, set(b_keys))
        wait_for(alice_rec, set(a_keys) - a_held)
        assert not set(alice_rec.evicted) & set(b_keys)
    finally:
        a_check.close()
        b_check.close()
        alice.close()
        bob.close()
        n.stop()


def test_a_restarted_node_is_noticed_and_read_from_zero(secret_file: Path) -> None:
    n = PeerNode(["--max-size", str(3 * frame_len() + frame_len() // 2)], secret_file)
    eng, rec = engine({"peers": [n.address], "secret_file": str(secret_file), "retry_after_s": 0.0})
    check = client_for(n)
    try:
        assert eng.tiers[1].poll_evictions() == 0  # first contact: from the head on
        n.kill()
        n.start()  # same port, new server id, empty
        first = store(eng, 4, 1)  # reconnects to the new node
        deadline = time.monotonic() + WAIT_S
        while eng.tiers[1].stats().extra.get("node_restarts", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.tiers[1].stats().extra["node_restarts"] == 1
        keys = first + store(eng, 5, 5)
        still = held(check, keys)
        assert len(still) == 3
        wait_for(rec, set(keys) - still)
    finally:
        check.close()
        eng.close()
        n.stop()


def test_a_node_without_a_log_turns_polling_off(secret_file: Path) -> None:
    n = PeerNode(["--max-size", str(3 * frame_len() + frame_len() // 2), "--eviction-log", "0"], secret_file)
    eng, rec = engine({"peers": [n.address], "secret_file": str(secret_file)})
    try:
        store(eng, 6, 6)
        deadline = time.monotonic() + WAIT_S
        while eng.tiers[1].stats().extra["eviction_events"] != {n.address: "off"} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.tiers[1].stats().extra["eviction_events"] == {n.address: "off"}
        assert rec.evicted == []  # the node evicted, but cannot say so
        assert eng.tiers[1].poll_evictions() == 0
    finally:
        eng.close()
        n.stop()


OLD_NODE = """
import sys
from lmcache_backend_peer import protocol
from lmcache_backend_peer.cli import main
del protocol.TYPE_NAMES[protocol.EVICTIONS], protocol.TYPE_NAMES[protocol.EVICTIONS_OK]
sys.exit(main(sys.argv[1:]))
"""


def test_a_node_older_than_the_message_turns_polling_off_and_keeps_serving(secret_file: Path) -> None:
    """A node whose decoder predates EVICTIONS (it drops the connection on the unknown
    type, as version-1 nodes do): polling stops for it, everything else works."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", OLD_NODE, "--listen", "127.0.0.1:0", "--secret-file", str(secret_file), "--max-size", "1MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.split()[-1]
        eng, rec = engine({"peers": [address], "secret_file": str(secret_file)})
        try:
            assert eng.tiers[1].stats().extra["eviction_events"] == {address: "off"}
            tokens = tokens_for(9, 2)
            assert store_tokens(eng, tokens, chunks_for(9, 2)) == 2 and eng.flush(30)
            host, port = address.rsplit(":", 1)
            check = PeerClient((host, int(port)), SECRET.encode(), timeout=2.0)
            assert check.lookup(eng.keys(token_hashes(eng, tokens))) == 2  # pushes still land
            check.close()
            assert eng.tiers[1].poll_evictions() == 0
            assert rec.evicted == []
        finally:
            eng.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_no_listener_no_polling(secret_file: Path) -> None:
    n = PeerNode(["--max-size", "1MiB"], secret_file)
    cfg = load_config(
        overrides={
            "chunk_size": CHUNK,
            "backends": [{"name": "peer", "peers": [n.address], "secret_file": str(secret_file), "push": True, "max_size": 0}],
        }
    )
    eng = CacheEngine(cfg, namespace=KeyNamespace(model="m"))
    try:
        assert eng.tiers[0]._poller is None
        assert "eviction_events" not in eng.tiers[0].stats().extra
        eng.add_listener(lambda ev: None)
        assert eng.tiers[0]._poller is not None and eng.tiers[0]._poller.is_alive()
    finally:
        eng.close()
        n.stop()


def test_the_engines_own_store_reports_its_evictions() -> None:
    """A peer-to-peer tier (no node): its own LRU store's evictions are reported; a
    remove() is not an eviction."""
    cfg = load_config(
        overrides={
            "chunk_size": CHUNK,
            "backends": [
                {"name": "local_cpu", "max_size": "16MiB"},
                {"name": "peer", "listen": "127.0.0.1:0", "secret": SECRET, "max_size": 3 * frame_len() + 10},
            ],
        }
    )
    eng = CacheEngine(cfg, namespace=KeyNamespace(model="m"))
    rec = Recorder()
    eng.add_listener(rec)
    try:
        keys = store(eng, 7, 5)
        tier = eng.tiers[1]
        kept = {k for k in keys if tier.store.contains([k])}
        assert len(kept) == 3
        assert set(rec.evicted) == set(keys) - kept
        assert tier.remove(sorted(kept, key=lambda k: k.chunk_hash)[0])
        assert set(rec.evicted) == set(keys) - kept
    finally:
        eng.close()


# -- the log and the wire ----------------------------------------------------------------
def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"), (i + 1).to_bytes(16, "big"))


def test_log_ring_wraps_and_tells_the_gap() -> None:
    log = EvictionLog(capacity=4)
    for i in range(10):
        log.record("t", key(i))
    assert log.since("other", 0) == (0, 0, [])
    first, head, keys = log.since("t", 0)
    assert (first, head) == (6, 10)  # 0..5 fell out of the ring
    assert keys == [p.key_bytes(key(i)) for i in range(6, 10)]
    assert log.since("t", 8, limit=1) == (8, 10, [p.key_bytes(key(8))])
    assert log.since("t", (1 << 64) - 1) == (10, 10, [])


def test_frame_store_drops_are_attributed_to_tenants() -> None:
    from lmcache_backend_peer.tenants import TenantSource

    fl = frame_len()
    store = FrameStore(2 * fl)
    log = EvictionLog(8)
    log.watch(store, ["a", "b"])
    frames = {i: encode(key(i), torch.zeros(SHAPE, dtype=torch.float16), RawCodec()) for i in range(4)}
    TenantSource(store, "a").put_frame(key(0), frames[0])
    TenantSource(store, "b").put_frame(key(1), frames[1])
    store.put_frame(key(2), frames[2])  # untenanted: evicts a's key(0)
    store.put_frame(key(3), frames[3])  # evicts b's key(1)
    assert log.since("a", 0)[2] == [p.key_bytes(key(0))]
    assert log.since("b", 0)[2] == [p.key_bytes(key(1))]
    assert log.since(None, 0)[2] == []
    assert log.unattributed == 0


def test_evictions_reply_round_trip_and_hostile_replies() -> None:
    keys = [p.key_bytes(key(i)) for i in range(3)]
    msg = p.parse_body(p.EVICTIONS_OK, p.encode_evictions_reply(5, 9, keys))
    assert msg == p.EvictionsReply(5, 9, [key(0), key(1), key(2)])
    assert p.parse_body(p.EVICTIONS, p.u64(7)) == p.EvictionsRequest(7)
    hdr = struct.Struct(">QQI")
    bad = {
        "too many": hdr.pack(0, 1 << 20, p.MAX_EVICTIONS_PER_REPLY + 1),
        "past head": hdr.pack(8, 9, 3) + b"".join(keys),
        "truncated": hdr.pack(0, 3, 3) + b"".join(keys)[:-1],
        "trailing": hdr.pack(0, 3, 3) + b"".join(keys) + b"x",
        "short": b"\x00" * 10,
    }
    for what, body in bad.items():
        with pytest.raises(ProtocolError):
            p.parse_body(p.EVICTIONS_OK, body)
        assert what
    for body in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(ProtocolError):
            p.parse_body(p.EVICTIONS, body)
    with pytest.raises(ValueError):
        p.encode_evictions_reply(0, 5000, [keys[0]] * (p.MAX_EVICTIONS_PER_REPLY + 1))
