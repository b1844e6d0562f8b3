"""Retention hints: chunks a request asked to keep for a while outlive the others.

A request may carry ``retention_seconds`` and a ``priority`` (0-99, higher kept
first; the vocabulary of SGLang's and TensorRT-LLM's retention hints). The chunks it
stores or hits are *retained* until that time has passed (a later request can only
extend it, and raises the priority to the highest asked). A byte-budgeted tier that
takes hints (the CPU tier) skips a retained chunk when its eviction policy offers it,
hands it back to the policy as it does a pinned one, and so honours the hint
whatever the policy. Retention is a bias with a bound, never a lock: retained chunks
hold at most ``share`` of the tier; past it the weakest retentions (lowest priority,
then soonest to expire) are released, and an expired one is an ordinary chunk again.

Hints for chunks not resident yet (a save still in flight) wait in a bounded table
and apply when the chunk arrives. :class:`Retention` is the bookkeeping; the tier
calls it under its own lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterable, TypeVar

Key = TypeVar("Key", bound=Hashable)

MAX_PRIORITY = 99
#: longest retention a request may ask for (30 days)
MAX_SECONDS = 30 * 24 * 3600.0
#: hints kept for chunks not resident yet (oldest dropped past this)
MAX_PENDING = 65536


class Retention(Generic[Key]):
    """Which resident keys are retained, until when, at what priority; their bytes
    bounded by ``share`` of ``capacity``. Not thread-safe (the tier's lock)."""

    def __init__(self, capacity: int, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = int(capacity * share)
        self.clock = clock
        self._held: dict[Key, tuple[float, int, int]] = {}  # key -> (until, priority, size)
        self._pending: OrderedDict[Key, tuple[float, int]] = OrderedDict()
        self.bytes = 0
        self.kept = 0  # evictions a retention prevented
        self.expired = 0
        self.released = 0  # retentions given up to stay within the share

    def __len__(self) -> int:
        return len(self._held)

    def add(self, keys: Iterable[Key], seconds: float, priority: int, size_of: Callable[[Key], int | None]) -> int:
        """Retain ``keys`` for ``seconds`` at ``priority`` (extend-only); ``size_of``
        gives a resident key's size, None for one not resident (kept pending). How
        many resident keys are retained."""
        if not seconds > 0:
            return 0
        until = self.clock() + min(float(seconds), MAX_SECONDS)
        priority = max(0, min(int(priority), MAX_PRIORITY))
        n = 0
        for key in keys:
            size = size_of(key)
            if size is None:
                old_p = self._pending.pop(key, None)
                self._pending[key] = (max(until, old_p[0]), max(priority, old_p[1])) if old_p else (until, priority)
                while len(self._pending) > MAX_PENDING:
                    self._pending.popitem(last=False)
                continue
            self._hold(key, until, priority, size)
            n += 1
        self._trim()
        return n

    def _hold(self, key: Key, until: float, priority: int, size: int) -> None:
        old = self._held.get(key)
        if old is None:
            self.bytes += size
            self._held[key] = (until, priority, size)
        else:
            self._held[key] = (max(until, old[0]), max(priority, old[1]), old[2])

    def arrived(self, key: Key, size: int) -> None:
        """``key`` became resident: a pending hint for it applies now."""
        hint = self._pending.pop(key, None) if self._pending else None
        if hint is not None and hint[0] > self.clock():
            self._hold(key, hint[0], hint[1], size)
            self._trim()

    def protects(self, key: Key) -> bool:
        """The policy offers ``key`` as a victim: True to keep it (retained, not
        expired); an expired retention is dropped here."""
        held = self._held.get(key) if self._held else None
        if held is None:
            return False
        if held[0] > self.clock():
            self.kept += 1
            return True
        self._drop(key)
        self.expired += 1
        return False

    def forget(self, key: Key) -> None:
        """``key`` left the tier."""
        if self._held and key in self._held:
            self._drop(key)

    def release(self, key: Key) -> bool:
        """End ``key``'s retention (live or waiting for the key); whether it had one."""
        live = key in self._held and self._held[key][0] > self.clock()
        if key in self._held:
            self._drop(key)
        return self._pending.pop(key, None) is not None or live

    def _drop(self, key: Key) -> None:
        self.bytes -= self._held.pop(key)[2]

    def sweep(self) -> None:
        """Drop expired retentions (otherwise dropped when their key is offered)."""
        now = self.clock()
        for key in [k for k, h in self._held.items() if h[0] <= now]:
            self._drop(key)
            self.expired += 1

    def _trim(self) -> None:
        if self.bytes <= self.budget:
            return
        self.sweep()
        if self.bytes <= self.budget:
            return
        # weakest first: lowest priority, then soonest to expire
        for key, _ in sorted(self._held.items(), key=lambda kv: (kv[1][1], kv[1][0])):
            if self.bytes <= self.budget:
                break
            self._drop(key)
            self.released += 1

    def stats(self) -> dict[str, int]:
        """Counts after a sweep: ``retained`` chunks and bytes are live retentions."""
        if self._held:
            self.sweep()
        return {
            "retained": len(self._held),
            "retained_bytes": self.bytes,
            "retention_kept": self.kept,
            "retention_expired": self.expired,
            "retention_released": self.released,
        }
