"""A circuit breaker for remote tiers: once a store is down, calls are misses at once.

Without it every lookup against a dead endpoint would pay the connect timeout times
the retry count, on every engine step. After a failure that means "unavailable"
(refused, timed out, 5xx after retries, cluster down) the gate stays closed for
``cooldown_s``; then one call probes and its outcome opens or closes the gate again.
Backends (ours and third parties') share this one implementation.
"""

from __future__ import annotations

import threading
import time


class HealthGate:
    def __init__(self, cooldown_s: float) -> None:
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._probing = False
        self.trips = 0

    def allow(self) -> bool:
        """True if a call may go out now (the store is up, or this call is the probe)."""
        with self._lock:
            if self._down_until == 0.0:
                return True
            if time.monotonic() < self._down_until or self._probing:
                return False
            self._probing = True
            return True

    def blocked(self) -> bool:
        """True while the store is known down (no call would be allowed now)."""
        with self._lock:
            return self._down_until != 0.0 and (time.monotonic() < self._down_until or self._probing)

    def failed(self) -> bool:
        """Close the gate; True if it was open (the first failure of an outage, worth
        one log line)."""
        with self._lock:
            first = self._down_until == 0.0
            if first:
                self.trips += 1
            self._down_until = time.monotonic() + self.cooldown_s
            self._probing = False
            return first

    def succeeded(self) -> bool:
        """Open the gate; True if it was closed (the store just came back)."""
        with self._lock:
            was_down = self._down_until != 0.0
            self._down_until = 0.0
            self._probing = False
            return was_down

    @property
    def down(self) -> bool:
        with self._lock:
            return self._down_until != 0.0
