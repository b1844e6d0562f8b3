"""Tier quarantine: a tier caught serving wrong KV is taken out of service.

The correctness canary (``verify_fraction``) recomputes a sample of cache hits and
compares them with the stored objects; each mismatch is reported here against the
tier that served the object. ``verify_mismatch_limit`` mismatches within
``verify_window_s`` seconds quarantine the tier: the engine no longer reads from it
nor writes to it, until the process restarts or an operator releases it.

Releasing works across processes through a *control file*: a quarantined tier is
announced as ``<quarantine_dir>/<tier>.<pid>-<engine>.quarantined`` (JSON: tier,
pid, since, reason). Deleting that file (``lmcache-core quarantine release <tier>``,
or ``rm``) releases the tier; the engine notices within :data:`RECHECK_S` seconds.

Deleting a file releases a tier, so who may delete it matters: the control
directory must be private to the engine's user. It is created with mode 0700 and
checked through the descriptor the engine then works in (a directory, not a
symbolic link, owned by the engine's effective uid, writable by nobody else); a
directory that fails the check (another local user created it first, it is a link,
or it is group/world writable) is refused with an error, and the quarantine is kept
in memory only: it holds until the process restarts. Control files are written to a
fresh temporary name and renamed into place inside that descriptor, so no symbolic
link or FIFO planted under the control file's name is ever followed or opened, and
readers (the CLI) read at most :data:`MAX_CONTROL_BYTES` of a regular file without
following links or blocking.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection

log = logging.getLogger(__name__)

SUFFIX = ".quarantined"
RECHECK_S = 1.0  # how often a quarantined tier's control file is checked
MAX_CONTROL_BYTES = 64 * 1024  # a control file is about 200 bytes; larger ones are not read
MAX_REASON_CHARS = 2000  # what the engine writes stays far below MAX_CONTROL_BYTES
MAX_ENTRIES = 10_000  # directory entries one listing looks at
_LAST_SINCE = 253402300800.0  # year 10000: later times cannot be shown


class UnsafeDirError(Exception):
    """The control directory exists but must not be trusted (who could write it)."""


def default_dir() -> Path:
    """Where control files go when ``quarantine_dir`` is not set: a directory of this
    user only, ``$XDG_RUNTIME_DIR/lmcache-core-quarantine`` when that is a private
    directory of ours, else ``<tmpdir>/lmcache-core-quarantine-<euid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.lstat(runtime)
            _check_dir(st, runtime, {os.geteuid()})
            return Path(runtime) / "lmcache-core-quarantine"
        except (OSError, UnsafeDirError):
            pass  # e.g. sudo kept the invoking user's XDG_RUNTIME_DIR
    return Path(tempfile.gettempdir()) / f"lmcache-core-quarantine-{os.geteuid()}"


def _check_dir(st: os.stat_result, path: str | os.PathLike[str], owners: Collection[int]) -> None:
    """Raise :class:`UnsafeDirError` unless ``st`` is a directory owned by one of
    ``owners`` that nobody else can write (only its owner can add or delete files)."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirError(f"{path} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(f"{path} is not a directory")
    if st.st_uid not in owners:
        raise UnsafeDirError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafeDirError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def open_private_dir(path: str | os.PathLike[str], *, create: bool, owners: Collection[int] | None = None) -> int:
    """A descriptor of directory ``path`` after checking it (see :func:`_check_dir`;
    ``owners`` defaults to this process's euid). ``create`` makes it (mode 0700, its
    parents as usual) when missing. The check is made on the opened descriptor, so
    the directory cannot be swapped between check and use; everything else happens
    relative to the descriptor. Raises :class:`UnsafeDirError` or :class:`OSError`."""
    owners = {os.geteuid()} if owners is None else owners
    p = Path(path)
    if create:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # checked below like any other existing directory
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirError(f"{p} is a symbolic link" if p.is_symlink() else f"{p} is not a directory") from None
        raise
    try:
        _check_dir(os.fstat(fd), p, owners)
    except BaseException:
        os.close(fd)
        raise
    return fd


def printable(text: str) -> str:
    """``text`` with control characters (ANSI escapes, newlines, bidi overrides) and
    backslashes escaped as in Python literals, so that a terminal shows it as is."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c.isprintable():
            out.append(c)
        else:
            out.append(repr(c)[1:-1])  # repr escapes exactly the characters that are not printable
    return "".join(out)


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
class _Control:
    """A written control file: its name inside the checked directory ``dir_fd``."""

    dir_fd: int
    name: str
    path: Path

    def announced(self) -> bool:
        """False only once the file is gone from a directory that is still private;
        anything else (the file is there, an I/O error) keeps the quarantine."""
        try:
            os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return True

    def still_private(self) -> str | None:
        """Why the directory can no longer be trusted, or None."""
        try:
            _check_dir(os.fstat(self.dir_fd), self.path.parent, {os.geteuid()})
        except (OSError, UnsafeDirError) as err:
            return str(err)
        return None

    def remove(self) -> None:
        try:
            os.unlink(self.name, dir_fd=self.dir_fd)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


@dataclass
class _Entry:
    since: float
    reason: str
    control: _Control | None
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
            reason = reason[:MAX_REASON_CHARS]
            control = self._write_control(tier, reason)
            self._held[tier] = _Entry(self.clock(), reason, control, self.clock())
            self._windows.pop(tier, None)
        how = (
            f"release it with `lmcache-core quarantine release {tier}` (or delete {control.path})"
            if control is not None
            else "it stays quarantined until this process restarts (kept in memory only: no control file)"
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
        with self._lock:  # the descriptor is closed only under the lock or after a pop
            if self._held.get(tier) is not e:
                return tier in self._held
            e.checked = now
            c = e.control
            if c is None:
                return True
            why = c.still_private()
            if why is None and c.announced():
                return True
            if why is not None:
                e.control = None
                c.close()
        if why is not None:
            # Others could now delete the file: a deletion no longer says who did it.
            log.error(
                "quarantine of tier %s: %s; its control file no longer counts, the tier stays quarantined "
                "until this process restarts",
                tier,
                why,
            )
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
            e.control.remove()
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
                e.control.remove()

    def _write_control(self, tier: str, reason: str) -> _Control | None:
        """Announce ``tier`` in the checked control directory, or None (with an error
        log) when the directory is refused or the file cannot be written."""
        name = f"{_safe(tier)}.{self._id}{SUFFIX}"
        try:
            dir_fd = open_private_dir(self.control_dir, create=True)
        except UnsafeDirError as err:
            log.error(
                "quarantine_dir refused: %s (another user could delete or plant control files there); the quarantine "
                "of tier %s is kept in memory only",
                err,
                tier,
            )
            return None
        except OSError as err:
            log.warning("quarantine control directory %s could not be used: %s", self.control_dir, err)
            return None
        data = json.dumps({"tier": tier, "pid": os.getpid(), "since": time.time(), "reason": reason}) + "\n"
        try:
            write_in_dir(dir_fd, name, data)
        except OSError as err:
            log.warning("quarantine control file %s could not be written: %s", self.control_dir / name, err)
            os.close(dir_fd)
            return None
        return _Control(dir_fd, name, self.control_dir / name)


def write_in_dir(dir_fd: int, name: str, data: str) -> None:
    """Write ``name`` in the checked directory ``dir_fd``: a fresh name (O_EXCL, no
    link followed), then an atomic rename over the final name, so whatever sat there
    (a link, a FIFO) is replaced, never opened. OSError (the temp file removed)."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


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
        return pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_names(dir_fd: int, suffix: str) -> tuple[list[str], bool]:
    """The names ending in ``suffix`` (dot files apart) in directory ``dir_fd``, sorted,
    among its first :data:`MAX_ENTRIES` entries; and whether there were more."""
    names: list[str] = []
    with os.scandir(dir_fd) as it:
        for n, entry in enumerate(it):
            if n >= MAX_ENTRIES:
                return sorted(names), True
            if entry.name.endswith(suffix) and not entry.name.startswith("."):
                names.append(entry.name)
    return sorted(names), False


class Skip(Exception):
    """A directory entry that is not a readable control file (the text says why)."""


def read_bounded(dir_fd: int, name: str) -> bytes:
    """At most :data:`MAX_CONTROL_BYTES` of regular file ``name``: links are not
    followed, FIFOs and devices are not opened (and would not block if they were)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as err:
        raise Skip(f"cannot be read: {err.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise Skip("is a symbolic link (control files are never followed)")
    if not stat.S_ISREG(st.st_mode):
        raise Skip("is not a regular file (a FIFO, device, socket or directory)")
    if st.st_size > MAX_CONTROL_BYTES:
        raise Skip(f"is too large ({st.st_size} bytes; a control file has at most {MAX_CONTROL_BYTES})")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as err:
        raise Skip(f"cannot be read: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the lstat
            raise Skip("is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_CONTROL_BYTES:
            b = os.read(fd, MAX_CONTROL_BYTES + 1 - size)
            if not b:
                break
            chunks.append(b)
            size += len(b)
    except OSError as err:
        raise Skip(f"cannot be read: {err.strerror}") from None
    finally:
        os.close(fd)
    if size > MAX_CONTROL_BYTES:
        raise Skip(f"is too large (over {MAX_CONTROL_BYTES} bytes)")
    return b"".join(chunks)


def _parse(path: Path, raw: bytes) -> ControlFile:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Skip("is not valid JSON") from None
    if not isinstance(data, dict):
        raise Skip("is not a JSON object")
    tier, pid, since, reason = (data.get(k) for k in ("tier", "pid", "since", "reason"))
    if not isinstance(tier, str) or not isinstance(reason, str):
        raise Skip("has no valid tier or reason (text)")
    if type(pid) is not int or not 0 < pid < 2**31:
        raise Skip("has no valid pid")
    if isinstance(since, bool) or not isinstance(since, (int, float)) or not 0 <= since < _LAST_SINCE:
        raise Skip("has no valid time")  # NaN fails the range too
    return ControlFile(path, tier, pid, float(since), reason)


def scan_control_files(dir_fd: int, directory: str | os.PathLike[str]) -> tuple[list[ControlFile], list[tuple[str, str]]]:
    """The control files in the checked directory ``dir_fd`` (named ``directory``),
    and ``(name, why)`` for each ``*.quarantined`` entry that is not one. Bounded:
    at most :data:`MAX_ENTRIES` entries, :data:`MAX_CONTROL_BYTES` per file."""
    d = Path(directory)
    names, more = list_names(dir_fd, SUFFIX)
    skipped: list[tuple[str, str]] = []
    if more:
        skipped.append(("…", f"more than {MAX_ENTRIES} entries in the directory: the rest were not read"))
    files = []
    for name in names:
        try:
            files.append(_parse(d / name, read_bounded(dir_fd, name)))
        except Skip as why:
            skipped.append((name, str(why)))
    return files, skipped


def cli_owners() -> set[int]:
    """Whose control directories the CLI reads: this user's, and root's (a root
    engine's files, for a user allowed to read them)."""
    return {os.geteuid(), 0}


def list_control_files(control_dir: str | os.PathLike[str] | None = None) -> list[ControlFile]:
    """The quarantines announced in ``control_dir`` (a directory that is missing or
    fails :func:`open_private_dir`'s check gives none; unreadable files are skipped)."""
    d = Path(control_dir) if control_dir is not None else default_dir()
    try:
        fd = open_private_dir(d, create=False, owners=cli_owners())
    except (OSError, UnsafeDirError):
        return []
    try:
        return scan_control_files(fd, d)[0]
    finally:
        os.close(fd)
