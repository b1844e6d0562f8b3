"""Which temp files are writes in progress, and so count in the shared budget.

A temp name declares its writer's pid and its frame's size
(``.tmp-<pid>-<rand>-<bytes>``, directory.py), and every process recounting the
directory adds up the sizes of the writes in progress. Trusting any name would let
a planted empty file (``.tmp-1-x-<huge>``: pid 1 is always alive; an mtime in the
future is never old) take the whole budget of every process: all chunks evicted,
every put skipped. So a temp counts only when all of this holds:

* its name is exactly :func:`~.directory.temp_name`'s format, with bounded digits,
  and its size is at most the tier's ``max_size``;
* its mtime is neither older than :data:`STALE_TEMP_S` nor more than
  :data:`FUTURE_SLACK_S` in the future;
* its writer is live: a write this process has in flight (:func:`track`), or the
  pid is held in the tier's owner file by another process.

The owner file ``<path>/LMCACHE_DISK_TIER.owners`` holds no data: every process using
the tier holds a shared POSIX record lock (``fcntl``) on the byte at offset ``pid``
for as long as it has the tier open, and ``F_GETLK`` on that byte asks whether some
other process holds it. The kernel drops the lock when the process exits (a crash
included) and does not hand it to a forked child, so a pid only counts while a
process that opened this tier under that pid is alive: an unrelated live process
(pid 1) or a recycled pid does not. Processes of another pid namespace (containers
sharing the directory) that happen to have the same pid both hold the byte, which
keeps each other's temps, as it should. POSIX locks belong to the process and are
all dropped when it closes *any* descriptor of the file, so each process opens the
owner file once per directory (:data:`_HELD`), never again, and asks through that
descriptor.

What this does not stop: a hostile process that can write the directory and stays
alive can hold its own pid's byte; its temps then count, each at most ``max_size``.
Such a process can delete the chunks directly anyway.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import sys
import threading
import time
from dataclasses import dataclass

from .directory import OWNERS, parse_temp_name
from .fileio import open_regular

log = logging.getLogger(__name__)

STALE_TEMP_S = 3600.0  # a write in progress for longer than this is a leftover
FUTURE_SLACK_S = 60.0  # an mtime this far ahead of the clock was not set by a write in progress
_FLOCK = struct.Struct("@hhqqi4x")  # Linux struct flock (l_type, l_whence, l_start, l_len, l_pid)
_GETLK = sys.platform.startswith("linux")


@dataclass
class _Held:
    pid: int  # the process that holds the lock (a forked child holds none)
    fd: int
    users: int
    spare: list[int]  # descriptors of the same file opened by a race: closing one would drop the lock


_HELD: dict[tuple[int, int], _Held] = {}  # (st_dev, st_ino) of an owner file -> our descriptor of it
_HELD_LOCK = threading.Lock()
_LIVE: set[str] = set()  # temp names this process is writing now (names carry 64 random bits)
_LIVE_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's locks and writes none of its temps:
    it closes the descriptors it inherited (before it locks anything, so that drops
    nothing) and takes its own lock when it next uses the tier (:meth:`Owners.claim`)."""
    global _HELD_LOCK, _LIVE_LOCK
    _HELD_LOCK, _LIVE_LOCK = threading.Lock(), threading.Lock()
    _LIVE.clear()
    for held in _HELD.values():
        for fd in [held.fd, *held.spare]:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def track(name: str) -> None:
    """``name`` is a temp this process is about to create: live until :func:`untrack`.
    Call before the file exists, so that no scan of this process sees it unlisted."""
    with _LIVE_LOCK:
        _LIVE.add(name)


def untrack(name: str) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(name)


def is_tracked(name: str) -> bool:
    return name in _LIVE


class Owners:
    """This process's hold on a tier directory's owner file, and the question whether
    another process holds a given pid's byte."""

    def __init__(self, root_fd: int) -> None:
        self._root_fd = root_fd
        self._key: tuple[int, int] | None = None
        self._pid = -1
        self.claim()

    def claim(self) -> None:
        """Hold this process's byte (again, in a forked child). Raises OSError when
        the owner file cannot be opened (it is then not a regular file, or the
        directory is read-only)."""
        pid = os.getpid()
        if self._pid == pid:
            return
        with _HELD_LOCK:
            try:
                st = os.stat(OWNERS, dir_fd=self._root_fd, follow_symlinks=False)
                key: tuple[int, int] | None = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                key = None
            held = _HELD.get(key) if key is not None else None
            if held is None or held.pid != pid:
                fd, st = open_regular(OWNERS, dir_fd=self._root_fd, flags=os.O_RDWR | os.O_CREAT)
                key = (st.st_dev, st.st_ino)
                held = _HELD.get(key)
                if held is not None and held.pid == pid:  # replaced between stat and open: one we hold
                    held.spare.append(fd)  # kept open: closing any descriptor of it would drop our lock
                else:
                    held = _Held(pid, fd, 0, [])
                    _HELD[key] = held
                    self._lock_byte(fd, pid)
            assert key is not None
            held.users += 1
            self._key, self._pid = key, pid

    @staticmethod
    def _lock_byte(fd: int, pid: int) -> None:
        for _ in range(100):  # another process's F_GETLK never conflicts; only a hostile write lock does
            try:
                fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, pid, os.SEEK_SET)
                return
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                time.sleep(0.01)
        log.warning("disk tier: another process write-locks this process's byte of %s; others may remove its temps", OWNERS)

    def held_by_other(self, pid: int) -> bool:
        """Whether a process other than this one holds ``pid``'s byte."""
        if self._pid != os.getpid():  # a forked child asks through a descriptor of its own
            try:
                self.claim()
            except OSError:
                return False
        held = _HELD.get(self._key) if self._key is not None else None
        if held is None or held.pid != os.getpid():
            return False
        if not _GETLK:  # no portable struct flock: fall back to the pid being alive
            return _pid_alive(pid)
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, pid, 1, 0)
        try:
            got = fcntl.fcntl(held.fd, fcntl.F_GETLK, query)
        except OSError:
            return False
        return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK

    def close(self) -> None:
        with _HELD_LOCK:
            held = _HELD.get(self._key) if self._key is not None else None
            self._key, self._pid = None, -1
            if held is None or held.pid != os.getpid():
                return
            held.users -= 1
            if held.users > 0:
                return
            for key, value in list(_HELD.items()):
                if value is held:
                    del _HELD[key]
            for fd in [held.fd, *held.spare]:  # the last user in this process: the lock goes with them
                try:
                    os.close(fd)
                except OSError:
                    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


class TempJudge:
    """Decides what a temp file reserves (see the module docstring)."""

    def __init__(self, owners: Owners | None, max_size: int) -> None:
        self.owners = owners
        self.max_size = max_size

    def reserved(self, name: str, st: os.stat_result, now: float) -> int | None:
        """The bytes the regular file ``name`` (its ``lstat`` ``st``) reserves as a
        write in progress, or None when it is a leftover or not a valid temp (the
        start-up scan removes it). A live writer's temp that declares more than
        ``max_size`` reserves nothing (kept: another process may have a larger
        budget)."""
        parsed = parse_temp_name(name)
        if parsed is None or not stat.S_ISREG(st.st_mode):
            return None
        pid, size = parsed
        if now - st.st_mtime >= STALE_TEMP_S or st.st_mtime > time.time() + FUTURE_SLACK_S:
            return None
        if not is_tracked(name) and (self.owners is None or not self.owners.held_by_other(pid)):
            return None
        return size if size <= self.max_size else 0
