"""Tier quarantine: a tier caught serving wrong KV is taken out of service.

The correctness canary (``verify_fraction``) recomputes a sample of cache hits and
compares them with the stored objects; each mismatch is reported here against the
tier that served the object. ``verify_mismatch_limit`` mismatches within
``verify_window_s`` seconds quarantine the tier: the engine no longer reads from it
nor writes to it, until the process restarts or an operator releases it.

Releasing works across processes through a *control file*: a quarantined tier is
announced as ``<quarantine_dir>/<tier>.<pid>-<engine>.quarantined`` (JSON: tier,
pid, when, why). Deleting that file (``lmcache-core quarantine release <tier>``, or
``rm``) releases the tier; the engine notices within :data:`RECHECK_S` seconds. If the
file cannot be written the quarantine holds until restart and a warning says so.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

SUFFIX = ".quarantined"
RECHECK_S = 1.0  # how often a quarantined tier's control file is checked


def default_dir() -> Path:
    """Where control files go when ``quarantine_dir`` is not set."""
    return Path(tempfile.gettempdir()) / "lmcache-core-quarantine"


class MismatchWindow:
    """Mismatch times of one tier within a sliding window of ``window_s`` seconds."""

    def __init__(self, limit: int, window_s: float) -> None:
        if limit < 1 or window_s <= 0:
            raise ValueError(f"limit must be >= 1 and window_s > 0, got {limit}, {window_s}")
        self.limit = limit
        self.window_s = window_s
        self._times: deque[float] = deque()

    def add(self, now: float) -> bool:
        """Record one mismatch at ``now``; True when the window now holds ``limit``."""
        self._times.append(now)
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        while len(self._times) > self.limit:  # bounded: only the newest ``limit`` matter
            self._times.popleft()
        return len(self._times) >= self.limit

    def __len__(self) -> int:
        return len(self._times)


@dataclass
class _Entry:
    since: float
    reason: str
    control: Path | None
    checked: float


class Quarantine:
    """Per-tier mismatch windows and the set of quarantined tiers of one engine."""

    _serial = 0

    def __init__(
        self,
        limit: int,
        window_s: float,
        control_dir: str | os.PathLike[str] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.control_dir = Path(control_dir) if control_dir is not None else default_dir()
        self.clock = clock
        self.on_change = on_change
        self._windows: dict[str, MismatchWindow] = {}
        self._held: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        with self._lock:
            Quarantine._serial += 1
            self._id = f"{os.getpid()}-{Quarantine._serial}"

    def record_mismatch(self, tier: str, detail: str = "") -> bool:
        """Count one mismatch of ``tier``; True if this one quarantined it."""
        with self._lock:
            if tier in self._held:
                return False
            w = self._windows.setdefault(tier, MismatchWindow(self.limit, self.window_s))
            if not w.add(self.clock()):
                return False
            reason = f"{self.limit} verification mismatches within {self.window_s:g} s" + (f" (last: {detail})" if detail else "")
            control = self._write_control(tier, reason)
            self._held[tier] = _Entry(self.clock(), reason, control, self.clock())
            self._windows.pop(tier, None)
        how = (
            f"release it with `lmcache-core quarantine release {tier}` (or delete {control})"
            if control is not None
            else "it stays quarantined until this process restarts (the control file could not be written)"
        )
        log.error("tier %s QUARANTINED: %s; no reads from it and no writes to it; %s", tier, reason, how)
        if self.on_change is not None:
            self.on_change(tier, True)
        return True

    def is_quarantined(self, tier: str) -> bool:
        """Whether ``tier`` is out of service (checks its control file at most every
        :data:`RECHECK_S` seconds; a deleted file releases the tier)."""
        e = self._held.get(tier)
        if e is None:
            return False
        now = self.clock()
        if e.control is None or now - e.checked < RECHECK_S:
            return True
        e.checked = now
        if e.control.exists():
            return True
        self.release(tier, by="its control file was deleted")
        return False

    def release(self, tier: str, *, by: str = "an admin action") -> bool:
        """Put ``tier`` back in service; False if it was not quarantined."""
        with self._lock:
            e = self._held.pop(tier, None)
            self._windows.pop(tier, None)
        if e is None:
            return False
        if e.control is not None:
            try:
                e.control.unlink(missing_ok=True)
            except OSError:
                pass
        log.warning("tier %s released from quarantine (%s)", tier, by)
        if self.on_change is not None:
            self.on_change(tier, False)
        return True

    def quarantined(self) -> list[str]:
        return [t for t in list(self._held) if self.is_quarantined(t)]

    def mismatches(self, tier: str) -> int:
        """Mismatches of ``tier`` in its current window (0 once quarantined)."""
        with self._lock:
            w = self._windows.get(tier)
            return len(w) if w is not None else 0

    def close(self) -> None:
        """Remove this engine's control files (the quarantine ends with the process)."""
        with self._lock:
            held, self._held = self._held, {}
        for e in held.values():
            if e.control is not None:
                try:
                    e.control.unlink(missing_ok=True)
                except OSError:
                    pass

    def _write_control(self, tier: str, reason: str) -> Path | None:
        path = self.control_dir / f"{_safe(tier)}.{self._id}{SUFFIX}"
        try:
            self.control_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"tier": tier, "pid": os.getpid(), "since": time.time(), "reason": reason}) + "\n")
        except OSError as err:
            log.warning("quarantine control file %s could not be written: %s", path, err)
            return None
        return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "_"


@dataclass(frozen=True)
class ControlFile:
    path: Path
    tier: str
    pid: int
    since: float
    reason: str

    @property
    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def list_control_files(control_dir: str | os.PathLike[str] | None = None) -> list[ControlFile]:
    """The quarantines announced in ``control_dir`` (unreadable files are skipped)."""
    d = Path(control_dir) if control_dir is not None else default_dir()
    out = []
    for p in sorted(d.glob(f"*{SUFFIX}")) if d.is_dir() else []:
        try:
            data = json.loads(p.read_text()[:4096])
            out.append(ControlFile(p, str(data["tier"]), int(data["pid"]), float(data["since"]), str(data["reason"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
