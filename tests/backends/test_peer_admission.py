"""A peer node admits connections so that clients without the secret never starve
those with it (checked on a real ``lmcache-core serve`` in a child process, loopback only):

* unauthenticated connections have a budget of their own per transport (TCP, Unix
  socket), a cap per address, per subnet (IPv4 /24, IPv6 /64) and per local user,
  and a short handshake deadline; a full budget makes room by fair share (the oldest
  connection of the subnet or process holding most), never ping-pong.
* so a flood of a few hundred idle sockets, from one host or many, or a few addresses
  re-opening idle sockets every period on TCP and the Unix socket, never keeps an
  authenticated client (fresh or pooled) from being served. Negative control: with the
  per-address cap as large as the whole budget and a long handshake deadline, the same
  flood starves fresh connections.

Other loopback addresses (127.0.0.2, 127.0.1.1, ...) stand for other hosts: Linux lets
a socket bind any 127/8 address as its source, and the node counts IPv4 /24s, so
127.0.1.x and 127.0.0.1 are different subnets.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_clients import SECRET, frame_of, port_of, start_node, stored_keys, write_secret  # noqa: E402
from peer_node import PeerNode  # noqa: E402

from lmcache_backend_peer import PeerClient, create_peer_backend  # noqa: E402
from lmcache_backend_peer import protocol as p  # noqa: E402
from lmcache_backend_peer.backend import PeerBackend  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402
from lmcache_core.testing import make_context, random_key  # noqa: E402

if TYPE_CHECKING:
    from lmcache_backend_peer.limits import Admission, Origin, Slot

FLOOD_SOCKETS = 300
WINDOW_S = 2.0


@pytest.fixture(scope="module")
def guarded_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerNode]:
    """A node with tight admission limits: 32 unauthenticated connections, 4 per
    address, a 0.5 s handshake deadline."""
    options = ["--max-size", "64MiB", "--timeout-s", "2", "--max-unauthenticated", "32"]
    options += ["--max-unauthenticated-per-address", "4", "--handshake-timeout-s", "0.5"]
    node = start_node(tmp_path_factory.mktemp("guarded-node"), options)
    yield node
    node.stop()


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


def fresh_lookups_under_flood(node: PeerNode, sources: list[str]) -> tuple[int, int, Flood]:
    """(succeeded, attempted) fresh-connection lookups of stored keys while a
    :class:`Flood` from ``sources`` holds idle sockets open on ``node``; the flood."""
    keys = stored_keys(node)
    flood = Flood(port_of(node), sources)
    try:
        time.sleep(0.5)
        ok, tried = fresh_lookups(port_of(node), keys, WINDOW_S)
    finally:
        flood.stop()
    return ok, tried, flood


def test_flood_from_one_host_never_starves_fresh_authenticated_connections(guarded_node: PeerNode) -> None:
    ok, tried, flood = fresh_lookups_under_flood(guarded_node, ["127.0.0.2"])
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


def test_negative_control_without_a_per_address_cap_the_flood_starves_new_connections(tmp_path: Path) -> None:
    """Admission with no per-address cap and a handshake deadline as long as a request's.
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
        write_secret(tmp_path),
    )
    try:
        ok, tried, _ = fresh_lookups_under_flood(node, ["127.0.0.1"])
        print(f"control, no per-address cap: fresh lookups {ok}/{tried}")
        assert tried >= 10 and ok / tried < 0.5, (ok, tried)
    finally:
        node.stop()


# -- admission by transport, subnet and address -----------------------------------------------
def admit_all(adm: Admission, origins: list[Origin]) -> tuple[list[Slot], list[str], list[Slot]]:
    """(admitted, refusals, evicted) for ``origins`` admitted in turn."""
    admitted: list[Slot] = []
    refused: list[str] = []
    evicted: list[Slot] = []
    for o in origins:
        box: list[Slot] = []
        slot = adm.admit(o, lambda box=box: evicted.extend(box))
        if isinstance(slot, str):
            refused.append(slot)
        else:
            box.append(slot)
            admitted.append(slot)
    return admitted, refused, evicted


def test_admission_keeps_transports_apart_and_caps_addresses_and_subnets() -> None:
    from lmcache_backend_peer.limits import Admission, Origin, Slot, tcp_origin, unix_origin

    adm = Admission(64, 32, 4)
    assert adm.max_per_subnet == 16
    # One address, 5 sockets: 4 get in.
    ok, refused, _ = admit_all(adm, [tcp_origin("127.0.2.1")] * 5)
    assert len(ok) == 4 and refused == ["too many unauthenticated connections from this address"]
    for s in ok:
        adm.leave(s)
    # 8 addresses of one /24 taking turns, 5 sockets each: the subnet's 16, 2 each
    # (none holds 2 more than another, so nobody is evicted).
    same_net = [tcp_origin(f"127.0.1.{i}") for _ in range(5) for i in range(1, 9)]
    ok, refused, evicted = admit_all(adm, same_net)
    assert (len(ok), len(evicted)) == (16, 0) and refused == ["too many unauthenticated connections from this subnet"] * 24
    # Another /24 and the Unix socket are untouched by it.
    assert isinstance(adm.admit(tcp_origin("127.0.0.1"), lambda: None), Slot)
    assert all(isinstance(adm.admit(unix_origin(100 + i, 0), lambda: None), Slot) for i in range(4))
    assert (adm.waiting("tcp"), adm.waiting("unix")) == (17, 4)
    # IPv6 counts /64s; an IPv4-mapped address counts as the IPv4 one.
    assert tcp_origin("2001:db8:1:2::7").subnet == tcp_origin("2001:db8:1:2:ffff::1").subnet == "2001:db8:1:2::/64"
    assert tcp_origin("::ffff:10.1.2.3") == Origin("tcp", "10.1.2.0/24", "10.1.2.3")
    assert tcp_origin("not-an-ip") == Origin("tcp", "not-an-ip", "not-an-ip")


def test_a_full_budget_makes_room_by_fair_share_and_never_ping_pongs() -> None:
    from lmcache_backend_peer.limits import Admission, Slot, tcp_origin

    adm = Admission(64, 32, 4)
    flood = [tcp_origin(f"127.0.{n}.1") for _ in range(4) for n in range(1, 9)]  # 8 /24s x 4
    ok, refused, evicted = admit_all(adm, flood)
    assert (len(ok), refused, evicted) == (32, [], [])
    # A newcomer from a subnet with nothing waiting gets in: the oldest connection of
    # a subnet holding 4 is closed for it.
    newcomer = adm.admit(tcp_origin("127.0.0.1"), lambda: None)
    assert isinstance(newcomer, Slot) and len(evicted) == 1 and evicted[0] is ok[0] and ok[0].evicted
    assert adm.waiting("tcp") == 32 and adm.evictions == 1
    # The evicted side (now 3) cannot take it back from anyone: no subnet holds 5.
    again, refused, evicted2 = admit_all(adm, [ok[0].origin] * 3)
    assert again == [] and evicted2 == [] and refused == ["unauthenticated connection budget full"] * 3
    # An evicted connection that then proves the secret gets no slot; leave() is idempotent.
    assert not adm.authenticated(ok[0])
    adm.leave(ok[0])
    adm.leave(ok[0])
    assert adm.authenticated(newcomer) and adm.counts() == (1, 31)
    adm.leave(newcomer)
    adm.leave(newcomer)
    assert adm.counts() == (0, 31)


def test_fair_share_stops_when_every_subnet_holds_one() -> None:
    from lmcache_backend_peer.limits import Admission, tcp_origin

    adm = Admission(64, 32, 4)
    ok, refused, _ = admit_all(adm, [tcp_origin(f"10.{n}.0.1") for n in range(32)])
    assert len(ok) == 32
    assert adm.admit(tcp_origin("10.99.0.1"), lambda: None) == "unauthenticated connection budget full"


def test_local_processes_of_one_user_share_its_part_fairly() -> None:
    from lmcache_backend_peer.limits import Admission, Slot, unix_origin

    adm = Admission(64, 32, 4)
    ok, refused, evicted = admit_all(adm, [unix_origin(1000 + i, 7) for _ in range(4) for i in range(8)])
    assert len(ok) == 16 and len(refused) == 16 and evicted == []  # the user's half of the Unix budget
    # Another process of that user (an engine) gets in: a process holding 2 gives one up.
    assert isinstance(adm.admit(unix_origin(4242, 7), lambda: None), Slot) and len(evicted) == 1
    assert isinstance(adm.admit(unix_origin(5000, 8), lambda: None), Slot)  # another user: its own share
    assert adm.waiting("unix") == 17 and adm.waiting("tcp") == 0


# -- idle sockets on a node: the attack, measured ----------------------------------------------
ATTACK_PERIOD_S = 0.9
SOCKETS_PER_SOURCE = 4
LEGIT_LOOKUPS = 59
LEGIT_MAX_S = 30.0


UNIX_ATTACKER = r"""
import select, socket, sys, time
path, n, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
held = []
end = time.monotonic() + 60
while time.monotonic() < end:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        socks.append(s)
    if select.select([sys.stdin], [], [], period)[0]:
        break
    n_held = 0
    for s in socks:
        try:  # refused: closed with nothing sent; evicted: the challenge, then closed
            if s.recv(4096, socket.MSG_DONTWAIT):
                s.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            n_held += 1
        except OSError:
            pass
    held.append(n_held)
    for s in socks:
        s.close()
print(" ".join(map(str, held)), flush=True)
"""


class Attack:
    """``SOCKETS_PER_SOURCE`` idle TCP sockets from each of ``sources`` and from each of
    ``unix_processes`` child processes on the node's Unix socket, all closed and
    re-opened every ``ATTACK_PERIOD_S``; never a byte sent. Records how many of its
    TCP sockets the node still held (had sent its challenge and not closed) at the end
    of each period. Bounded: stops at ``stop()`` or after ``max_s``."""

    def __init__(self, port: int, sources: list[str], unix_socket: str, unix_processes: int, max_s: float = 60.0) -> None:
        self.port, self.sources, self.max_s = port, sources, max_s
        self.held: list[int] = []
        self.unix_held: list[int] = []
        self._stop = threading.Event()
        self._children = [
            subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", UNIX_ATTACKER, unix_socket, str(SOCKETS_PER_SOURCE), str(ATTACK_PERIOD_S)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(unix_processes)
        ]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self, source: str) -> socket.socket | None:
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.settimeout(1.0)
            s.connect(("127.0.0.1", self.port))
        except OSError:
            s.close()
            return None
        s.settimeout(None)  # blocking: a MSG_DONTWAIT read then says at once whether data is there
        return s

    def _run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < end:
            socks = [s for src in self.sources for _ in range(SOCKETS_PER_SOURCE) if (s := self._open(src))]
            self._stop.wait(ATTACK_PERIOD_S)
            self.held.append(sum(1 for s in socks if _still_held(s)))
            for s in socks:
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for c in self._children:
            out, _ = c.communicate("", timeout=10)
            self.unix_held += [int(x) for x in out.split()]


def _still_held(s: socket.socket) -> bool:
    """The node admitted ``s`` (its challenge is there) and has not closed it."""
    try:
        data = s.recv(4096, socket.MSG_DONTWAIT)
        if not data:
            return False  # refused: closed without a challenge
        return bool(s.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT))  # EOF: evicted
    except BlockingIOError:
        return True
    except OSError:
        return False


@dataclass
class Tally:
    tried: int = 0
    ok: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return self.tried - self.ok


def legit_lookups(address: tuple[str, int] | str, keys: list[ChunkKey], out: Tally) -> None:
    """``LEGIT_LOOKUPS`` lookups, each on a fresh connection (connect + handshake +
    LOOKUP, within the tier's default 2 s deadline), within ``LEGIT_MAX_S``."""
    end = time.monotonic() + LEGIT_MAX_S
    while out.tried < LEGIT_LOOKUPS and time.monotonic() < end:
        client = PeerClient(address, SECRET.encode(), timeout=2.0, pool_size=0)
        out.tried += 1
        try:
            out.ok += client.lookup(keys) == len(keys)
        except p.PeerError as err:
            out.errors.append(f"{type(err).__name__}: {err}")
        finally:
            client.close()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def lockout_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PeerNode, str]]:
    """A node with the default admission limits (32 unauthenticated, 4 per address,
    1 s handshake deadline) and a Unix socket."""
    d = tmp_path_factory.mktemp("lockout-node")
    sock = str(d / "node.sock")
    node = start_node(d, ["--max-size", "64MiB", "--unix-socket", sock, "--no-shm"])
    yield node, sock
    node.stop()


ATTACKS = {
    "8 addresses in one /24": ([f"127.0.1.{i}" for i in range(1, 9)], 0),
    "8 /24s": ([f"127.0.{n}.1" for n in range(1, 9)], 0),
    "8 /24s and 8 local processes": ([f"127.0.{n}.1" for n in range(1, 9)], 8),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_few_addresses_of_idle_sockets_lock_no_legitimate_client_out(lockout_node: tuple[PeerNode, str], attack: str) -> None:
    node, unix_socket = lockout_node
    sources, unix_processes = ATTACKS[attack]
    keys = [random_key() for _ in range(2)]
    writer = PeerClient(("127.0.0.1", node.port), SECRET.encode(), timeout=5.0)
    for i, k in enumerate(keys):
        assert writer.put(k, frame_of(k, i))
    writer.close()
    tcp, local = Tally(), Tally()
    flood = Attack(node.port, sources, unix_socket, unix_processes)
    try:
        time.sleep(2 * ATTACK_PERIOD_S)  # the attack holds its slots before the clients come
        clients = [
            threading.Thread(target=legit_lookups, args=(a, keys, t))
            for a, t in ((("127.0.0.1", node.port), tcp), (unix_socket, local))
        ]
        for t in clients:
            t.start()
        for t in clients:
            t.join(LEGIT_MAX_S + 10)
    finally:
        flood.stop()
    held = sorted(flood.held)
    unix_mean = sum(flood.unix_held) * unix_processes / max(len(flood.unix_held), 1)
    print(
        f"attack {attack}: failed lookups TCP {tcp.failed}/{tcp.tried}, Unix socket {local.failed}/{local.tried}; "
        f"attacker TCP sockets held per period: median {held[len(held) // 2]} of {len(sources) * SOCKETS_PER_SOURCE}"
        + (f"; Unix: {unix_mean:.1f} of {unix_processes * SOCKETS_PER_SOURCE} on average" if unix_processes else "")
    )
    assert tcp.tried == local.tried == LEGIT_LOOKUPS
    assert (tcp.failed, local.failed) == (0, 0), (tcp.errors, local.errors)
    from lmcache_backend_peer.limits import tcp_origin

    # Positive control: the attack did take its share of the TCP budget: its subnet's
    # half, or (from 8 /24s) the whole budget, so newcomers got in by eviction.
    assert held[len(held) // 2] >= (14 if len(set(tcp_origin(s).subnet for s in sources)) == 1 else 28), held
    if unix_processes:
        assert unix_mean >= 10, flood.unix_held  # of the user's 16
