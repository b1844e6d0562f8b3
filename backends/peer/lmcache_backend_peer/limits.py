"""What a peer server lets clients hold: connection slots and bytes in flight.

Two separate connection budgets, because an unauthenticated connection costs a thread
and a slot but proves nothing: :class:`Admission` gives connections that have not
yet proved the secret their own small budget, and counts authenticated ones against
``max_connections`` only once they have authenticated. A flood of idle sockets from a
client without the secret therefore never takes a slot an authenticated client needs.

The unauthenticated budget must not be a prize either, or a few hosts holding idle
sockets lock everyone else out before they can authenticate. So:

* each transport (TCP, the Unix socket) has a budget of its own: a TCP flood never
  touches local engines, nor a local one remote clients;
* within it, at most ``per_address`` connections come from one address (a TCP
  client's IP; a local client's process id) and at most ``per_subnet`` from one
  subnet (IPv4 /24, IPv6 /64: what one host or tenant network usually holds; a local
  client's user id): a handful of addresses in one network cannot fill the budget;
* when a newcomer finds its subnet's share, or the whole budget, full, the node
  makes room by fair share instead of refusing it: the oldest connection of the
  most represented subnet (and within that, address) is closed, if that subnet holds
  at least two more than the newcomer's. A client that knows the secret answers the
  challenge within a round trip, so the oldest waiting connection is almost always
  an idle one. The margin of two means an eviction never makes the evicted side
  smaller than the newcomer's, so two sides can never evict each other in turn:
  the budget settles into equal shares, and a newcomer from a subnet with no
  connection waiting gets in unless every subnet holds at most one. Only many
  distinct subnets (more than the budget) can still fill it.

:class:`ByteBudget` bounds request bodies held in memory at once across the node: a
body is reserved *before* it is allocated, so clients announcing large PUTs and then
stalling cannot make the node allocate more than the budget.
"""

from __future__ import annotations

import ipaddress
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable


class ByteBudget:
    """A counting semaphore over bytes."""

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError("the in-flight byte budget must be positive")
        self.total = total
        self._used = 0
        self._cv = threading.Condition()
        self.peak = 0

    def acquire(self, n: int, deadline: float) -> bool:
        """Reserve ``n`` bytes, waiting until ``deadline``; False if they never fit
        (``n`` above the whole budget fails at once)."""
        if n > self.total:
            return False
        with self._cv:
            while self._used + n > self.total:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            self._used += n
            self.peak = max(self.peak, self._used)
            return True

    def release(self, n: int) -> None:
        with self._cv:
            self._used -= n
            self._cv.notify_all()

    @property
    def used(self) -> int:
        with self._cv:
            return self._used


@dataclass(frozen=True)
class Origin:
    """Where a connection comes from, as admission counts it."""

    transport: str
    """``tcp`` or ``unix``: each has its own unauthenticated budget."""
    subnet: str
    """IPv4 /24 or IPv6 /64 (TCP), ``uid:N`` (Unix socket)."""
    address: str
    """The IP address (TCP), ``pid:N`` (Unix socket)."""


def tcp_origin(host: str) -> Origin:
    """A TCP client's origin; an IPv4-mapped IPv6 address counts as the IPv4 one."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return Origin("tcp", host, host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = 24 if ip.version == 4 else 64
    return Origin("tcp", str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False)), str(ip))


def unix_origin(pid: int | None, uid: int | None) -> Origin:
    """A Unix-socket client's origin (from SO_PEERCRED; None when it cannot be read)."""
    return Origin("unix", "uid:?" if uid is None else f"uid:{uid}", "pid:?" if pid is None else f"pid:{pid}")


_WAITING, _AUTHENTICATED, _EVICTED, _GONE = range(4)


class Slot:
    """One admitted connection's place in the counts (see :class:`Admission`)."""

    __slots__ = ("origin", "close", "seq", "state")

    def __init__(self, origin: Origin, close: Callable[[], None], seq: int) -> None:
        self.origin = origin
        self.close = close
        self.seq = seq  # admission order: lower is older
        self.state = _WAITING

    @property
    def evicted(self) -> bool:
        """Closed by the node to make room for a newer unauthenticated connection."""
        return self.state == _EVICTED


class _Pool:
    """The unauthenticated connections of one transport, by subnet and address, each
    address's oldest first."""

    def __init__(self) -> None:
        self.total = 0
        self.subnets: dict[str, dict[str, list[Slot]]] = {}
        self.per_subnet: dict[str, int] = {}

    def add(self, slot: Slot) -> None:
        o = slot.origin
        self.subnets.setdefault(o.subnet, {}).setdefault(o.address, []).append(slot)
        self.per_subnet[o.subnet] = self.per_subnet.get(o.subnet, 0) + 1
        self.total += 1

    def remove(self, slot: Slot) -> None:
        o = slot.origin
        addresses = self.subnets[o.subnet]
        addresses[o.address].remove(slot)
        if not addresses[o.address]:
            del addresses[o.address]
        self.per_subnet[o.subnet] -= 1
        if not self.per_subnet[o.subnet]:
            del self.per_subnet[o.subnet]
            del self.subnets[o.subnet]
        self.total -= 1

    def count(self, subnet: str, address: str | None = None) -> int:
        if address is None:
            return self.per_subnet.get(subnet, 0)
        return len(self.subnets.get(subnet, {}).get(address, ()))

    def oldest_of_largest(self, subnet: str) -> tuple[int, Slot]:
        """(connections, oldest connection) of ``subnet``'s most represented address
        (ties: the one waiting longest)."""
        slots = max(self.subnets[subnet].values(), key=lambda s: (len(s), -s[0].seq))
        return len(slots), slots[0]

    def largest_subnet(self) -> str:
        """The subnet holding most connections (ties: the one whose oldest waited longest)."""
        return max(
            self.per_subnet,
            key=lambda n: (self.per_subnet[n], -min(s[0].seq for s in self.subnets[n].values())),
        )


class Admission:
    """Connection slots: unauthenticated (per transport, per subnet, per address;
    full budgets make room by fair share, see the module doc) and authenticated."""

    def __init__(
        self,
        max_authenticated: int,
        max_unauthenticated: int,
        max_unauthenticated_per_address: int,
        max_unauthenticated_per_subnet: int | None = None,
    ) -> None:
        """``max_unauthenticated`` is per transport; ``max_unauthenticated_per_subnet``
        defaults to half of it (at least the per-address cap)."""
        self.max_authenticated = max_authenticated
        self.max_unauthenticated = max_unauthenticated
        self.max_per_address = max_unauthenticated_per_address
        self.max_per_subnet = (
            max_unauthenticated_per_subnet
            if max_unauthenticated_per_subnet is not None
            else max(max_unauthenticated // 2, max_unauthenticated_per_address)
        )
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        self._auth = 0
        self._seq = itertools.count()
        self.evictions = 0

    def admit(self, origin: Origin, close: Callable[[], None]) -> Slot | str:
        """Take an unauthenticated slot for a new connection from ``origin`` (``close``
        closes it, should it be evicted later): the slot, or why not. When the
        newcomer's subnet share or the transport's budget is full, the oldest
        connection of the most represented subnet (address, within the newcomer's
        subnet) is evicted, if that holds at least two more than the newcomer's;
        its ``close`` is called here, outside the lock."""
        with self._lock:
            pool = self._pools.setdefault(origin.transport, _Pool())
            mine = pool.count(origin.subnet, origin.address)
            if mine >= self.max_per_address:
                return "too many unauthenticated connections from this address"
            ours = pool.count(origin.subnet)
            victim: Slot | None = None
            if ours >= self.max_per_subnet:
                n, oldest = pool.oldest_of_largest(origin.subnet)
                if n < mine + 2:
                    return "too many unauthenticated connections from this subnet"
                victim = oldest
            elif pool.total >= self.max_unauthenticated:
                largest = pool.largest_subnet()
                if pool.count(largest) < ours + 2:
                    return "unauthenticated connection budget full"
                victim = pool.oldest_of_largest(largest)[1]
            if victim is not None:
                pool.remove(victim)
                victim.state = _EVICTED
                self.evictions += 1
            slot = Slot(origin, close, next(self._seq))
            pool.add(slot)
        if victim is not None:
            victim.close()
        return slot

    def authenticated(self, slot: Slot) -> bool:
        """Move a connection that proved the secret to an authenticated slot; False
        (and no slot held) when ``max_connections`` are already in use or the
        connection was evicted meanwhile (``slot.evicted``)."""
        with self._lock:
            if slot.state != _WAITING:
                return False
            self._pools[slot.origin.transport].remove(slot)
            if self._auth >= self.max_authenticated:
                slot.state = _GONE
                return False
            self._auth += 1
            slot.state = _AUTHENTICATED
            return True

    def leave(self, slot: Slot) -> None:
        """The connection closed: free whatever slot it holds (idempotent)."""
        with self._lock:
            if slot.state == _WAITING:
                self._pools[slot.origin.transport].remove(slot)
            elif slot.state == _AUTHENTICATED:
                self._auth -= 1
            if slot.state != _EVICTED:
                slot.state = _GONE

    def counts(self) -> tuple[int, int]:
        """(authenticated, unauthenticated) connections now."""
        with self._lock:
            return self._auth, sum(p.total for p in self._pools.values())

    def waiting(self, transport: str) -> int:
        """Unauthenticated connections on ``transport`` now."""
        with self._lock:
            pool = self._pools.get(transport)
            return 0 if pool is None else pool.total


# -- the admin API's request limits (here, not in .admin, so .openapi can describe them
# without importing the server) ---------------------------------------------------------
MAX_BODY = 64 << 10
"""Largest admin request body (an erase of a few hundred namespaces fits many times)."""
MAX_REQUEST_KEYS = 512
"""Chunk keys one admin lookup, retain or release names at most."""
MAX_ERASE_NAMESPACES = 1024
"""Namespace ids one admin erase names at most (a client sends more in several)."""
