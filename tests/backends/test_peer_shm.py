"""The same-host fast path of the peer tier: a cache node's frames in per-tenant sealed
shared memory, read in place by engines that authenticated on the node's Unix socket.

In-process servers on a Unix socket in ``tmp_path`` for the protocol and isolation
cases; a real ``lmcache-core serve`` process for restart and fallback."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from lmcache_backend_peer import PeerClient, PeerServer, create_peer_backend
from lmcache_backend_peer import protocol as p
from lmcache_backend_peer.auth import AuthError
from lmcache_backend_peer.backend import PeerBackend
from lmcache_backend_peer.connection import Connection
from lmcache_backend_peer.shm import (
    ARENA_SEALS,
    FREED,
    SHM_SUPPORTED,
    SLOT_HEADER,
    Arena,
    ArenaStore,
    Location,
    ShmUnavailable,
    ShmView,
)
from lmcache_backend_peer.store import FrameStore
from lmcache_core.keys import ChunkKey, KeyNamespace
from lmcache_core.serde import RawCodec, encode
from lmcache_core.testing import make_context

pytestmark = pytest.mark.skipif(not SHM_SUPPORTED, reason="the shared-memory fast path is x86-64 Linux only")

SECRET = "shm-test-secret-0123456789abcdef"
FRAME_KEY = "shm-test-frame-secret-0123456789"
A, B = "tenant-a", "tenant-b"
A_SECRET, B_SECRET = "tenant-a-secret-0123456789", "tenant-b-secret-9876543210"
SHAPE = (4, 256)  # 4 KiB of float32 per chunk
NS = KeyNamespace(model="shm-test")


def _key(i: int) -> ChunkKey:
    return NS.key(i.to_bytes(16, "big"))


def _chunk(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[1], dtype=torch.float32) / 1000


def _frame(i: int) -> bytes:
    return encode(_key(i), _chunk(i), RawCodec())


def _slot_bytes() -> int:
    return (SLOT_HEADER + len(_frame(0)) + 63) // 64 * 64


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "node.sock")


def _node(store: Any, path: str, **kw: Any) -> PeerServer:
    kw.setdefault("secret", SECRET.encode())
    return PeerServer(store, ("127.0.0.1", 0), kw.pop("secret"), writable=True, unix_socket=path, timeout=5.0, **kw)


def _backend(path: str, **section: Any) -> PeerBackend:
    cfg = {"unix_socket": path, "secret": SECRET, "max_size": 0, "push": True, "timeout_s": 5.0, **section}
    backend = create_peer_backend(cfg, make_context(pool_bytes=1 << 20))
    assert isinstance(backend, PeerBackend)
    return backend


@pytest.fixture
def shm_node(sock_path: str) -> Iterator[tuple[PeerServer, ArenaStore]]:
    store = ArenaStore(16 << 20, [None])
    server = _node(store, sock_path)
    yield server, store
    server.close()
    store.close()


def _get(backend: PeerBackend, i: int) -> torch.Tensor | None:
    out = torch.zeros(SHAPE)
    return out if backend.get(_key(i), out) else None


# -- arena and allocator ----------------------------------------------------------------------
def test_arena_lru_reuse_and_generations() -> None:
    slot = _slot_bytes()
    arena = Arena("unit", 3 * slot)
    try:
        for i in range(3):
            assert arena.put_frame(_key(i), _frame(i))
        locs = arena.locate([_key(i) for i in range(3)])
        assert all(loc is not None and loc.generation % 2 == 0 for loc in locs)
        assert len({loc.generation for loc in locs if loc}) == 3
        assert arena.locate([_key(0)])  # key 0 is now the most recently used
        assert arena.put_frame(_key(3), _frame(3))  # evicts key 1, the LRU one, reusing its slot
        assert arena.contains([_key(1)]) == 0 and arena.contains([_key(0)]) == 1
        new = arena.locate([_key(3)])[0]
        assert new is not None and locs[1] is not None and new.offset == locs[1].offset
        assert new.generation > max(loc.generation for loc in locs if loc)
        assert arena.bytes_used == 3 * slot and arena.evictions == 1
        assert arena.get_frame(_key(3)) == _frame(3)
        # freeing marks the slot odd at once; free neighbours coalesce back to one extent
        assert arena.remove(_key(0)) and arena.remove(_key(2)) and arena.remove(_key(3))
        assert int.from_bytes(arena._mm[new.offset : new.offset + 8], "little") == FREED
        assert arena._free == [(0, 3 * slot)] and arena.bytes_used == 0
        assert not arena.put_frame(_key(9), b"\0" * 64)  # not a frame: refused
        assert not arena.put_frame(_key(9), _frame(8))  # a frame of another key: refused
        big = encode(_key(5), torch.zeros(4 * slot // 4), RawCodec())
        assert not arena.put_frame(_key(5), big)  # larger than the arena
    finally:
        arena.close()


def test_generation_is_odd_while_the_node_writes() -> None:
    arena = Arena("unit", 4 * _slot_bytes())
    seen: list[int] = []
    try:
        assert arena.put_frame(_key(0), _frame(0))
        loc = arena.locate([_key(0)])[0]
        assert loc is not None
        assert arena.remove(_key(0))
        arena.write_hook = lambda: seen.append(int.from_bytes(arena._mm[loc.offset : loc.offset + 8], "little"))
        assert arena.put_frame(_key(1), _frame(1))  # reuses offset 0
        assert seen and seen[0] % 2 == 1
    finally:
        arena.close()


def test_store_splits_the_budget_among_principals() -> None:
    store = ArenaStore(8 << 20, [None, A, B])
    try:
        assert {k: a.size for k, a in store.arenas.items()} == {
            None: (8 << 20) // 3 // 64 * 64,
            A: (8 << 20) // 3 // 64 * 64,
            B: (8 << 20) // 3 // 64 * 64,
        }
        inodes = {os.fstat(a.fd).st_ino for a in store.arenas.values()}
        assert len(inodes) == 3  # one memfd each
    finally:
        store.close()


# -- round trip, fallback, switch ----------------------------------------------------------------
def test_round_trip_through_shared_memory(shm_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    backend = _backend(sock_path)
    try:
        for i in range(4):
            assert backend.put(_key(i), _chunk(i))
        assert backend.contains([_key(i) for i in range(5)]) == 4
        for i in range(4):
            got = _get(backend, i)
            assert got is not None and torch.equal(got, _chunk(i))
        assert _get(backend, 4) is None
        st = backend.stats()
        assert st.extra["shm_hits"] == 4 and st.hits == 4
        assert list(st.extra["shm"].values()) == ["mapped"]
        assert backend.get_many([_key(i) for i in range(4)], [torch.zeros(SHAPE) for _ in range(4)]) == [True] * 4
        assert backend.stats().extra["shm_hits"] == 8
    finally:
        backend.close()


def test_switch_off_uses_the_socket(shm_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    """Control for the round trip: ``shm: false`` still hits, without a single shm hit."""
    backend = _backend(sock_path, shm=False)
    try:
        assert backend.put(_key(1), _chunk(1))
        got = _get(backend, 1)
        assert got is not None and torch.equal(got, _chunk(1))
        assert backend.stats().extra.get("shm_hits", 0) == 0
        assert list(backend.stats().extra["shm"].values()) == ["off: not asked for"]
    finally:
        backend.close()


def test_a_node_without_shared_memory_serves_over_its_socket(sock_path: str) -> None:
    server = _node(FrameStore(16 << 20), sock_path)
    backend = _backend(sock_path)
    try:
        assert backend.put(_key(2), _chunk(2))
        got = _get(backend, 2)
        assert got is not None and torch.equal(got, _chunk(2))
        st = backend.stats()
        assert st.extra.get("shm_hits", 0) == 0
        (state,) = st.extra["shm"].values()
        assert state.startswith("off:") and "shared memory is off on this node" in state
    finally:
        backend.close()
        server.close()


def test_the_same_node_by_socket_and_tcp_is_asked_once(shm_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    server, _ = shm_node
    backend = _backend(sock_path, peers=[f"127.0.0.1:{server.address[1]}"])
    try:
        assert backend.put(_key(3), _chunk(3))  # both clients connect and learn the server id
        assert len(backend._peers) == 2 and len(backend._live_peers()) == 1
        assert _get(backend, 3) is not None and backend.stats().extra["shm_hits"] == 1
    finally:
        backend.close()


def test_tcp_clients_get_no_shared_memory(shm_node: tuple[PeerServer, ArenaStore]) -> None:
    server, _ = shm_node
    client = PeerClient(server.address, SECRET.encode(), timeout=5)
    try:
        with pytest.raises(ShmUnavailable):
            client.attach_shm()
        assert client.put(_key(1), _frame(1))
        conn = client._connect(time.monotonic() + 5)
        conn.send(p.SHM_ATTACH, 1, [], time.monotonic() + 5)
        header, body, fds = conn.recv_fds(time.monotonic() + 5, 1024)
        assert header.type == p.ERROR and fds == [] and b"Unix socket" in bytes(body)
        conn.close()
    finally:
        client.close()


def test_the_node_refuses_a_frame_that_fails_its_checksum(shm_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    _, store = shm_node
    client = PeerClient(sock_path, SECRET.encode(), timeout=5)
    try:
        bad = bytearray(_frame(5))
        bad[-3] ^= 0xFF
        assert not client.put(_key(5), bytes(bad))
        assert store.contains([_key(5)]) == 0
        assert client.put(_key(5), _frame(5))  # control: the intact frame is kept
        assert store.contains([_key(5)]) == 1
    finally:
        client.close()


# -- a slot reused under a reader is a miss ---------------------------------------------------------
def test_a_slot_reused_between_lookup_and_copy_is_a_miss(sock_path: str) -> None:
    store = ArenaStore(2 * _slot_bytes(), [None])  # room for two chunks
    server = _node(store, sock_path)
    backend = _backend(sock_path)
    try:
        assert backend.put(_key(0), _chunk(0)) and backend.put(_key(1), _chunk(1))
        assert backend.contains([_key(0)]) == 1  # location remembered
        loc0 = store.arenas[None].locate([_key(0)])[0]
        assert backend.put(_key(2), _chunk(2)) and backend.put(_key(3), _chunk(3))  # evict 0 and 1, reuse their slots
        assert store.arenas[None].locate([_key(2), _key(3)])[0] is not None
        assert loc0 is not None and loc0.offset in {x.offset for x in store.arenas[None].locate([_key(2), _key(3)]) if x}
        out = torch.zeros(SHAPE)
        assert not backend.get(_key(0), out)  # stale location, then LOCATE says gone: a miss
        assert not torch.equal(out, _chunk(2)) and not torch.equal(out, _chunk(3))
        # control: a key whose location stayed valid hits
        assert backend.contains([_key(2)]) == 1
        got = _get(backend, 2)
        assert got is not None and torch.equal(got, _chunk(2))
    finally:
        backend.close()
        server.close()
        store.close()


@pytest.mark.parametrize("rewrite", [True, False])
def test_a_slot_rewritten_during_the_copy_is_a_miss(sock_path: str, rewrite: bool) -> None:
    """The node reuses the slot after the engine copied and before it re-checks the
    generation (the hook stands for a slow copy). Control: the same hook, no rewrite."""
    store = ArenaStore(_slot_bytes(), [None])  # one slot: any put reuses it
    server = _node(store, sock_path)
    backend = _backend(sock_path)
    try:
        assert backend.put(_key(0), _chunk(0))
        assert backend.contains([_key(0)]) == 1
        view = backend._peers[0].shm
        assert view is not None
        calls: list[int] = []

        def hook() -> None:
            calls.append(1)
            if rewrite and len(calls) == 1:
                assert store.put_frame(_key(1), _frame(1))  # evicts key 0, same offset

        view.read_hook = hook
        out = torch.zeros(SHAPE)
        assert backend.get(_key(0), out) is (not rewrite)
        assert calls
        if rewrite:
            assert backend.stats().extra.get("shm_hits", 0) == 0 and backend.stats().misses == 1
        else:
            assert torch.equal(out, _chunk(0))
    finally:
        backend.close()
        server.close()
        store.close()


def test_forged_locations_are_misses(shm_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    _, store = shm_node
    backend = _backend(sock_path)
    try:
        assert backend.put(_key(0), _chunk(0)) and backend.contains([_key(0)]) == 1
        view = backend._peers[0].shm
        assert view is not None
        real = store.arenas[None].locate([_key(0)])[0]
        assert real is not None
        codecs = {"raw": RawCodec()}
        out = torch.zeros(SHAPE)
        forged = [
            Location(real.offset, real.length, real.generation + 2),  # forged generation
            Location(real.offset, real.length, real.generation + 1),  # odd
            Location(real.offset, 1 << 60, real.generation),  # huge length
            Location(view.size - 64, real.length, real.generation),  # past the end
            Location(real.offset + 8, real.length, real.generation),  # misaligned
            Location(real.offset, real.length - 1, real.generation),  # wrong length
        ]
        for loc in forged:
            assert view.read(_key(0), loc, out, codecs) is not None
        assert view.read(_key(1), real, out, codecs) == "slot reused"  # another key's location
        assert view.read(_key(0), real, torch.zeros(2, 2), codecs) is not None  # wrong shape: refused
        assert not out.any()
        assert view.read(_key(0), real, out, codecs) is None and torch.equal(out, _chunk(0))  # control
    finally:
        backend.close()


# -- trust: authentication, tenants, read-only ---------------------------------------------------------
@pytest.fixture
def tenant_node(sock_path: str) -> Iterator[tuple[PeerServer, ArenaStore]]:
    store = ArenaStore(16 << 20, [A, B])
    server = _node(store, sock_path, secret=None, tenants={A: A_SECRET.encode(), B: B_SECRET.encode()})
    yield server, store
    server.close()
    store.close()


def _attach_raw(path: str, secret: str, tenant: str | None) -> tuple[Connection, int]:
    client = PeerClient(path, secret.encode(), timeout=5, tenant=tenant)
    conn = client._connect(time.monotonic() + 5)
    conn.send(p.SHM_ATTACH, 1, [], time.monotonic() + 5)
    header, _, fds = conn.recv_fds(time.monotonic() + 5, 1024)
    assert header.type == p.SHM_OK and len(fds) == 1
    return conn, fds[0]


def test_each_tenant_gets_only_its_own_arena(tenant_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    _, store = tenant_node
    a = _backend(sock_path, secret=A_SECRET, tenant=A)
    b = _backend(sock_path, secret=B_SECRET, tenant=B)
    try:
        assert a.put(_key(7), _chunk(7))
        assert a.contains([_key(7)]) == 1 and b.contains([_key(7)]) == 0
        assert _get(b, 7) is None and _get(a, 7) is not None
        for tenant, secret in ((A, A_SECRET), (B, B_SECRET)):
            conn, fd = _attach_raw(sock_path, secret, tenant)
            try:
                assert os.fstat(fd).st_ino == os.fstat(store.arenas[tenant].fd).st_ino
                assert os.fstat(fd).st_ino != os.fstat(store.arenas[B if tenant == A else A].fd).st_ino
            finally:
                os.close(fd)
                conn.close()
        payload = _chunk(7).numpy().tobytes()[:256]
        view_a, view_b = a._peers[0].shm, b._peers[0].shm
        assert view_a is not None and view_b is not None
        assert bytes(view_a._mv).find(payload) >= 0  # control: A's mapping holds it
        assert bytes(view_b._mv).find(payload) == -1  # B's mapping never does
    finally:
        a.close()
        b.close()


def test_no_fd_without_authentication(tenant_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(sock_path)
    conn = Connection(raw, "raw")
    try:
        header, _, fds = conn.recv_fds(time.monotonic() + 5, 1024)
        assert header.type == p.CHALLENGE and fds == []
        conn.send(p.SHM_ATTACH, 1, [], time.monotonic() + 5)  # skipping the handshake
        with pytest.raises(p.PeerError):
            for _ in range(3):
                header, _, fds = conn.recv_fds(time.monotonic() + 5, 1024)
                assert fds == []
    finally:
        conn.close()
    wrong = PeerClient(sock_path, b"not-the-secret-0123456789", timeout=5, tenant=A)
    with pytest.raises(AuthError):
        wrong.attach_shm()
    wrong.close()


def test_the_engine_cannot_write_the_arena(tenant_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    conn, fd = _attach_raw(sock_path, A_SECRET, A)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & ARENA_SEALS == ARENA_SEALS
        size = os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a fresh writable open of the same file...
        try:
            with pytest.raises(PermissionError):  # ...still cannot map it writable
                mmap.mmap(reopened, size, mmap.MAP_SHARED, mmap.PROT_WRITE)
        finally:
            os.close(reopened)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # F_SEAL_SEAL: the seals stay
        mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ).close()  # reading is allowed
    finally:
        os.close(fd)
        conn.close()
    # control: the same checks on an unsealed memfd would have let it write
    plain = os.memfd_create("control")
    try:
        os.ftruncate(plain, 4096)
        mmap.mmap(plain, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
        with pytest.raises(ShmUnavailable, match="seals"):
            ShmView(os.dup(plain), 4096, b"")
    finally:
        os.close(plain)


# -- a real node: restart and fallback ----------------------------------------------------------------
def test_node_restart_misses_then_reattaches(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from peer_node import PeerNode

    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    path = str(tmp_path / "n.sock")
    node = PeerNode(["--max-size", "16MiB", "--unix-socket", path], secret_file=secret)
    backend = _backend(path, peers=[node.address], retry_after_s=0.0, timeout_s=2.0)
    try:
        assert backend.put(_key(0), _chunk(0)) and backend.contains([_key(0)]) == 1
        assert _get(backend, 0) is not None and backend.stats().extra["shm_hits"] == 1
        old = backend._peers[0].shm
        node.kill()
        t = time.monotonic()
        assert _get(backend, 0) is None  # the mapping outlives the node, but nothing is read from it
        assert backend.contains([_key(0)]) == 0
        assert time.monotonic() - t < 10
        node.start()  # same port, same socket path (the stale socket file is replaced)
        assert backend.contains([_key(0)]) == 0  # a new node: empty
        assert backend.put(_key(0), _chunk(0))
        got = _get(backend, 0)
        assert got is not None and torch.equal(got, _chunk(0))
        assert backend._peers[0].shm is not old and backend.stats().extra["shm_hits"] == 2
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    finally:
        backend.close()
        node.stop()


def test_socket_path_errors(tmp_path: Path, sock_path: str) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        _node(FrameStore(1 << 20), str(tmp_path / "file"))
    first = _node(FrameStore(1 << 20), sock_path)
    try:
        with pytest.raises(OSError, match="another node is listening"):
            _node(FrameStore(1 << 20), sock_path)
    finally:
        first.close()


# -- what the engine serves from an arena is verified ---------------------------------------------
def _payload_offset(store: ArenaStore, key: ChunkKey) -> int:
    loc = store.arenas[None].locate([key])[0]
    assert loc is not None
    return loc.offset + SLOT_HEADER + loc.length - 1  # the frame's last payload byte


def test_bytes_changed_in_the_arena_are_a_miss(shm_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    """Any process of the node's user can write an arena (``/proc/<pid>/mem``; here the
    node's own writable mapping stands for it): the copy is checked against the
    frame's checksum, as the socket path checks it. Control: the intact slot hits."""
    _, store = shm_node
    backend = _backend(sock_path)
    try:
        assert backend.put(_key(0), _chunk(0)) and backend.contains([_key(0)]) == 1
        got = _get(backend, 0)
        assert got is not None and torch.equal(got, _chunk(0))  # control
        at = _payload_offset(store, _key(0))
        store.arenas[None]._mm[at] ^= 0x40  # one bit of one element
        before = backend.stats()
        assert _get(backend, 0) is None, "a changed arena byte was served"
        after = backend.stats()
        assert after.extra["shm_hits"] == before.extra["shm_hits"] and after.misses == before.misses + 1
    finally:
        backend.close()


def _sealed_backend(path: str, secret: str) -> PeerBackend:
    cfg = {"unix_socket": path, "secret": SECRET, "max_size": 0, "push": True, "timeout_s": 5.0}
    backend = create_peer_backend(cfg, make_context(pool_bytes=1 << 20, frame_secret=secret))
    assert isinstance(backend, PeerBackend)
    return backend


def test_sealed_frames_through_a_node_without_the_secret(shm_node: tuple[PeerServer, ArenaStore], sock_path: str) -> None:
    """The node cannot check a MAC, so it keeps sealed frames after its header checks;
    the engine checks the MAC on the shared-memory read. A plain frame planted in the
    arena (valid checksum) is then a miss; another engine with the same secret hits."""
    _, store = shm_node
    writer, reader = _sealed_backend(sock_path, FRAME_KEY), _sealed_backend(sock_path, FRAME_KEY)
    try:
        assert writer.put(_key(0), _chunk(0)) and writer.put(_key(1), _chunk(1))
        assert reader.contains([_key(0), _key(1)]) == 2
        got = _get(reader, 0)
        assert got is not None and torch.equal(got, _chunk(0)) and reader.stats().extra["shm_hits"] == 1
        store.remove(_key(1))
        assert store.put_frame(_key(1), encode(_key(1), torch.full(SHAPE, 666.0), RawCodec()))  # planted
        assert reader.contains([_key(1)]) == 1
        assert _get(reader, 1) is None, "a planted plain frame was served to a sealed engine"
    finally:
        writer.close()
        reader.close()


def test_a_node_with_the_secret_refuses_unsealed_pushes(sock_path: str, tmp_path: Path) -> None:
    from lmcache_core.serde import FrameSeal

    store = ArenaStore(16 << 20, [None])
    server = _node(store, sock_path, seal=FrameSeal(FRAME_KEY))
    client = PeerClient(sock_path, SECRET.encode(), timeout=5)
    try:
        assert not client.put(_key(0), _frame(0))  # plain, valid checksum
        assert not client.put(_key(0), encode(_key(0), _chunk(0), RawCodec(), seal=FrameSeal("another-secret-0123456789")))
        assert store.contains([_key(0)]) == 0
        assert client.put(_key(0), encode(_key(0), _chunk(0), RawCodec(), seal=FrameSeal(FRAME_KEY)))  # control
        assert store.contains([_key(0)]) == 1
    finally:
        client.close()
        server.close()
        store.close()
