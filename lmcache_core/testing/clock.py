"""A clock tests set by hand, for code that takes ``clock: Callable[[], float]``
(retention, quarantine windows, the connector's settle timing)."""

from __future__ import annotations


class ManualClock:
    """Calling it answers ``now``; a test moves time by assigning or adding to it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
