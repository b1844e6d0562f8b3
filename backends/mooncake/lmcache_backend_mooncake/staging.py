"""Registered memory that transfers land in, with quarantine for failed transfers.

Gets never write into the engine's pool directly: a get that overruns its deadline
(or fails mid-transfer) may still be writing when the caller has already taken its
miss and handed the pool buffer to another chunk. So gets land here, are checked
here, and only a verified frame is copied into the caller's tensor. Memory of a
call that overran or failed in a way that may leave I/O in flight is quarantined
for ``quarantine_s`` instead of being reused. Small frame headers of puts live here
too, so a put's every byte comes from registered memory.
"""

from __future__ import annotations

import threading
import time
import torch

from lmcache_core.memory import MemoryBuffer, MemoryPool


class Staging:
    """One private pool; the tier registers ``(base, size)`` with each client it connects."""

    def __init__(self, size: int, quarantine_s: float) -> None:
        self.pool = MemoryPool(size, pin=False)
        self.quarantine_s = quarantine_s
        probe = self.pool.allocate((1,), torch.uint8)
        assert probe is not None
        storage = probe.tensor.untyped_storage()
        self.base, self.size = storage.data_ptr(), storage.nbytes()
        probe.release()
        self._lock = threading.Lock()
        self._quarantined: list[tuple[float, MemoryBuffer]] = []
        self.quarantined_total = 0
        self.full = 0

    def allocate(self, nbytes: int) -> MemoryBuffer | None:
        """A byte buffer of ``nbytes``, or None when staging is full (a miss, counted)."""
        self._sweep()
        buf = self.pool.allocate((nbytes,), torch.uint8)
        if buf is None:
            with self._lock:
                self.full += 1
        return buf

    def quarantine(self, bufs: list[MemoryBuffer]) -> None:
        """Keep ``bufs`` out of use for ``quarantine_s`` (a transfer may still touch them)."""
        until = time.monotonic() + self.quarantine_s
        with self._lock:
            self._quarantined.extend((until, b) for b in bufs)
            self.quarantined_total += len(bufs)

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._quarantined or self._quarantined[0][0] > now:
                return
            due = [b for t, b in self._quarantined if t <= now]
            self._quarantined = [(t, b) for t, b in self._quarantined if t > now]
        for b in due:
            b.release()

    @property
    def quarantined_bytes(self) -> int:
        with self._lock:
            return sum(b.size for _, b in self._quarantined)

    @property
    def used(self) -> int:
        return self.pool.used
