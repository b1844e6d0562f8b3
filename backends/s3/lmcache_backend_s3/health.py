"""A circuit breaker for the endpoint: once it is down, calls are misses at once.

Without it every lookup against a dead endpoint would pay the full connect timeout
times the retry count. After a failure that means "unavailable" (connection refused,
timeout, 5xx after retries) the gate stays closed for ``cooldown_s``; then one call
probes the endpoint and its outcome closes or reopens the gate.
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
        """True if a request may go out now (the endpoint is up, or this call probes)."""
        with self._lock:
            if self._down_until == 0.0:
                return True
            if time.monotonic() < self._down_until or self._probing:
                return False
            self._probing = True
            return True

    def blocked(self) -> bool:
        """True while the endpoint is known down (no request would be allowed now)."""
        with self._lock:
            return self._down_until != 0.0 and (time.monotonic() < self._down_until or self._probing)

    def failed(self) -> None:
        with self._lock:
            if self._down_until == 0.0:
                self.trips += 1
            self._down_until = time.monotonic() + self.cooldown_s
            self._probing = False

    def succeeded(self) -> None:
        with self._lock:
            self._down_until = 0.0
            self._probing = False

    @property
    def down(self) -> bool:
        with self._lock:
            return self._down_until != 0.0
