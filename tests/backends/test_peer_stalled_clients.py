"""A client that stalls mid-request holds the node's memory and threads only within
bounds (checked on a real ``lmcache-core serve`` in a child process, loopback only):

* PUT bodies announced and then stalled never push the node's RSS past its in-flight
  budget (``--max-inflight``); the surplus waits up to ``--timeout-s`` for room and is
  refused "busy", while small authenticated requests still go through.
* a read-only tier's server steps over a PUT body without reserving or holding it,
  and the connection stays in step for the next request.
* the rest of a request header must follow its first byte within ``--timeout-s``:
  a half-sent or trickled header is dropped at that deadline and its slot comes back,
  while a connection idle *between* requests stays open.
"""

from __future__ import annotations

import selectors
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_clients import SECRET, authenticated, port_of, start_node, stored_keys  # noqa: E402
from peer_node import PeerNode  # noqa: E402

from lmcache_backend_peer import PeerClient, create_peer_backend  # noqa: E402
from lmcache_backend_peer import protocol as p  # noqa: E402
from lmcache_backend_peer.backend import PeerBackend  # noqa: E402
from lmcache_backend_peer.connection import Connection  # noqa: E402
from lmcache_backend_peer.shm import SHM_SUPPORTED  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

MiB = 1 << 20


# -- bytes in flight -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inflight_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerNode]:
    """A node with a 64 MiB in-flight budget and a 2 s request deadline."""
    options = ["--max-size", "64MiB", "--max-frame-size", "64MiB", "--max-inflight", "64MiB", "--timeout-s", "2"]
    node = start_node(tmp_path_factory.mktemp("inflight-node"), options)
    yield node
    node.stop()


def stalled_put(address: tuple[str, int], body_len: int, sent: int) -> socket.socket:
    """Authenticate, announce a PUT of ``body_len`` bytes, send ``sent`` of them, stall."""
    conn = authenticated(address, "staller")
    conn.sock.sendall(p.pack_header(p.PUT, 1, body_len) + b"\0" * sent)
    return conn.sock


def test_stalled_puts_cannot_push_the_node_past_its_inflight_budget(inflight_node: PeerNode) -> None:
    budget, body, n = 64 * MiB, 60 * MiB, 6
    node = inflight_node
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


@pytest.mark.skipif(not SHM_SUPPORTED, reason="shared-memory arenas need Linux memfd")
def test_stalled_get_replies_from_shared_memory_stay_within_the_inflight_budget() -> None:
    """A node with shared-memory arenas copies each frame out of the mapping for a
    socket GET and holds the copies until the reply is sent: six clients asking for
    32 MiB each and never reading held 192 MiB past the budget. The reply bytes are
    reserved in flight now. Control: a client that reads gets every frame right."""
    import tracemalloc

    from lmcache_backend_peer import PeerServer
    from lmcache_backend_peer.shm import ArenaStore
    from lmcache_core.serde import RawCodec, encode

    budget, frame_bytes, n_keys, clients = 8 * MiB, 4 * MiB, 8, 6
    keys = [random_key() for _ in range(n_keys)]
    chunks = [random_chunk(shape=(frame_bytes // 2,), seed=i) for i in range(n_keys)]
    store = ArenaStore(64 * MiB, [None])
    arena = store.arena_for(None)
    for k, c in zip(keys, chunks):
        assert arena.put_frame(k, encode(k, c, RawCodec()))
    srv = PeerServer(store, ("127.0.0.1", 0), SECRET.encode(), timeout=3.0, max_inflight_bytes=budget)
    stalled: list[Connection] = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(clients):
            c = authenticated(srv.address, "stalled-get")
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.send(p.GET, 1, [p.encode_keys(keys)], time.monotonic() + 2)
            stalled.append(c)
        time.sleep(1.0)
        held = tracemalloc.get_traced_memory()[0] - base
        print(f"stalled GETs: the node holds {held / MiB:.1f} MiB (budget {budget // MiB} MiB)")
        assert held <= budget + 2 * MiB, f"{held / MiB:.0f} MiB held for {clients} stalled GETs"
        for c in stalled:
            c.close()
        stalled = []
        deadline = time.monotonic() + 15  # their handlers end (at the latest at the 3 s send deadline)
        while srv._conns and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.1)
        frames = PeerClient(srv.address, SECRET.encode(), timeout=5.0, pool_size=0).get(keys)
        assert all(f is not None and bytes(f) == encode(k, c, RawCodec()) for f, k, c in zip(frames, keys, chunks))
    finally:
        tracemalloc.stop()
        for c in stalled:
            c.close()
        srv.close()
        store.close()


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


# -- a partial request header is bounded by the request deadline -----------------------------
REQUEST_TIMEOUT_S = 1.5
HALF_HEADERS = 8
HOLD_BOUND_S = REQUEST_TIMEOUT_S + 4.0
"""How long the test waits for the node to drop a half-header connection (far below
the 300 s idle deadline that would otherwise hold it)."""


@pytest.fixture(scope="module")
def deadline_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerNode]:
    """A node whose authenticated slots are exactly the half-header clients plus the
    idle control connection, so holding them is seen by a fresh client."""
    options = ["--max-size", "16MiB", "--timeout-s", str(REQUEST_TIMEOUT_S), "--max-connections", str(HALF_HEADERS + 1)]
    node = start_node(tmp_path_factory.mktemp("deadline-node"), options)
    yield node
    node.stop()


def lookup_message(rid: int, key: ChunkKey | None = None) -> bytes:
    body = p.encode_keys([key or random_key()])
    return p.pack_header(p.LOOKUP, rid, len(body)) + body


def is_open(conn: Connection) -> bool:
    """The node has not closed ``conn`` (nothing to read, no EOF)."""
    conn.sock.settimeout(None)  # blocking: MSG_DONTWAIT then answers at once (a timeout would wait)
    try:
        return conn.sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def drop_times(conns: list[Connection], since: float, bound_s: float) -> list[float | None]:
    """Seconds from ``since`` until the node closed each of ``conns`` (None: still
    open after ``bound_s``)."""
    out: list[float | None] = [None] * len(conns)
    sel = selectors.DefaultSelector()
    for i, c in enumerate(conns):
        sel.register(c.sock, selectors.EVENT_READ, i)
    end = since + bound_s
    while sel.get_map() and (left := end - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            try:
                data = conns[key.data].sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                out[key.data] = time.monotonic() - since
                sel.unregister(key.fileobj)
    sel.close()
    return out


def test_a_half_sent_header_is_dropped_at_the_request_deadline(deadline_node: PeerNode) -> None:
    address = port_of(deadline_node)
    idle = authenticated(address)  # negative control: authenticated, idle between requests
    idle_since = time.monotonic()
    half = p.HEADER_SIZE // 2
    attackers = [authenticated(address) for _ in range(HALF_HEADERS)]
    try:
        for i, c in enumerate(attackers):
            c.sock.sendall(lookup_message(i + 1)[:half])  # half a header, then nothing
        sent = time.monotonic()
        # Positive control: the half-header connections hold their slots (with the idle
        # one, all of --max-connections), so a fresh client is refused meanwhile.
        fresh = PeerClient(address, SECRET.encode(), timeout=1.0, pool_size=0)
        with pytest.raises(p.PeerError):
            fresh.lookup([random_key()])
        times = drop_times(attackers, sent, HOLD_BOUND_S)
        shown = ", ".join("held" if t is None else f"{t:.2f}" for t in times)
        print(f"{HALF_HEADERS} half-header connections dropped after (s): {shown} (request deadline {REQUEST_TIMEOUT_S} s)")
        assert all(t is not None for t in times), f"still held after {HOLD_BOUND_S} s: {shown}"
        assert all(REQUEST_TIMEOUT_S - 0.1 <= t <= REQUEST_TIMEOUT_S + 1.5 for t in times if t is not None), shown
        # Legitimate clients are served again: the slots came back.
        served = sum(fresh.lookup([random_key()]) == 0 for _ in range(5))
        assert served == 5
        fresh.close()
        # The idle connection stayed, past twice the request deadline...
        time.sleep(max(0.0, idle_since + 2 * REQUEST_TIMEOUT_S - time.monotonic()))
        assert is_open(idle), "the node dropped a connection idle between requests"
        print(f"idle control connection open after {time.monotonic() - idle_since:.2f} s")
        # ...and a request on it whose header comes in two parts within the deadline is answered.
        k = random_key()
        msg = lookup_message(77, k)
        idle.sock.sendall(msg[:half])
        time.sleep(REQUEST_TIMEOUT_S / 3)
        idle.sock.sendall(msg[half:])
        header, body = idle.recv(time.monotonic() + 5, 1 << 20)
        assert (header.type, header.request_id, p.parse_body(header.type, body)) == (p.LOOKUP_OK, 77, p.Count(0))
    finally:
        for c in [idle, *attackers]:
            c.close()


def test_a_trickled_header_is_dropped_at_the_request_deadline(deadline_node: PeerNode) -> None:
    """One byte every third of the deadline: each byte is on time, the header is not."""
    conn = authenticated(port_of(deadline_node))
    msg = lookup_message(5)
    try:
        start = time.monotonic()
        sent = 0
        dropped_at: float | None = None
        while time.monotonic() - start < HOLD_BOUND_S and sent < p.HEADER_SIZE - 1:
            try:
                conn.sock.sendall(msg[sent : sent + 1])
            except OSError:
                break
            sent += 1
            time.sleep(REQUEST_TIMEOUT_S / 3)
            if not is_open(conn):
                dropped_at = time.monotonic() - start
                break
        print(f"trickled header: dropped after {dropped_at} s, {sent} of {p.HEADER_SIZE} bytes sent")
        assert dropped_at is not None and dropped_at <= REQUEST_TIMEOUT_S + 1.5
    finally:
        conn.close()
