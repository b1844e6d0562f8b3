"""What a peer server lets clients hold: connection slots and bytes in flight.

Two separate connection budgets, because an unauthenticated connection costs a thread
and a slot but proves nothing: :class:`Admission` gives connections that have not
yet proved the secret their own small budget (and a per-address cap, so one host
cannot take all of it), and counts authenticated ones against ``max_connections``
only once they have authenticated. A flood of idle sockets from a client without the
secret therefore never takes a slot an authenticated client needs.

:class:`ByteBudget` bounds request bodies held in memory at once across the node: a
body is reserved *before* it is allocated, so clients announcing large PUTs and then
stalling cannot make the node allocate more than the budget.
"""

from __future__ import annotations

import threading
import time
from collections import Counter


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


class Admission:
    """Connection slots: unauthenticated (total and per address) and authenticated."""

    def __init__(self, max_authenticated: int, max_unauthenticated: int, max_unauthenticated_per_address: int) -> None:
        self.max_authenticated = max_authenticated
        self.max_unauthenticated = max_unauthenticated
        self.max_per_address = max_unauthenticated_per_address
        self._lock = threading.Lock()
        self._unauth = 0
        self._by_address: Counter[str] = Counter()
        self._auth = 0

    def admit(self, address: str) -> str | None:
        """Take an unauthenticated slot for a new connection from ``address``; None
        when admitted, else why not."""
        with self._lock:
            if self._unauth >= self.max_unauthenticated:
                return "unauthenticated connection budget full"
            if self._by_address[address] >= self.max_per_address:
                return "too many unauthenticated connections from this address"
            self._unauth += 1
            self._by_address[address] += 1
            return None

    def _drop_unauth(self, address: str) -> None:
        self._unauth -= 1
        self._by_address[address] -= 1
        if self._by_address[address] <= 0:
            del self._by_address[address]

    def authenticated(self, address: str) -> bool:
        """Move a connection that proved the secret to an authenticated slot; False
        (and no slot held) when ``max_connections`` are already in use."""
        with self._lock:
            self._drop_unauth(address)
            if self._auth >= self.max_authenticated:
                return False
            self._auth += 1
            return True

    def leave(self, address: str, was_authenticated: bool) -> None:
        with self._lock:
            if was_authenticated:
                self._auth -= 1
            else:
                self._drop_unauth(address)

    def counts(self) -> tuple[int, int]:
        """(authenticated, unauthenticated) connections now."""
        with self._lock:
            return self._auth, self._unauth
