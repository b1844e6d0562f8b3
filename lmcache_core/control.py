"""Erase requests to running engines, through the control directory.

The CPU tier (and any tier in the engine's memory pool) lives inside each running
engine; ``lmcache-core erase`` reaches it through the same private control directory
the quarantine uses (``quarantine_dir``, see :mod:`lmcache_core.quarantine`: a
directory of this user only, checked on the descriptor, files written by rename):

* every engine announces itself there while it runs, ``<pid>-<n>.engine`` (JSON: pid,
  namespace id), and polls the directory every :data:`POLL_S` seconds;
* the command lists the live engines (a file whose pid is gone is stale and removed),
  writes one request ``<id>.erase`` (JSON: namespaces or all, dry run, a deadline),
  and waits up to its deadline for each live engine's answer ``<id>.<pid>-<n>.done``
  (JSON: the chunks it erased from its memory tiers); then it removes the request and
  the answers. An engine that did not answer in time makes the erase partial.

A request past its deadline is ignored (a command that died leaves no request for
engines started later to act on). Everything read from the directory is bounded
(:data:`~lmcache_core.quarantine.MAX_CONTROL_BYTES` per file, at most
:data:`~lmcache_core.quarantine.MAX_ENTRIES` entries) and parsed as untrusted.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .backend import EraseMatch, StorageBackend
from .namespaces import namespace_of
from .quarantine import (
    MAX_ENTRIES,
    Skip,
    UnsafeDirError,
    default_dir,
    list_names,
    open_private_dir,
    pid_alive,
    read_bounded,
    write_in_dir,
)

if TYPE_CHECKING:
    from .config import BackendSection
    from .plugins import PluginManager

log = logging.getLogger(__name__)

ENGINE = ".engine"
REQUEST = ".erase"
DONE = ".done"
POLL_S = 0.5
#: how long the command waits for the engines' answers by default
WAIT_S = 5.0
#: the longest a request waits for engines (and lives in the directory): later ones are refused
MAX_WAIT_S = 600.0
#: namespace ids one request names at most (a request stays far below the size limit)
MAX_IDS = 1024


def _names(dir_fd: int, suffix: str) -> list[str]:
    return list_names(dir_fd, suffix)[0]


def _json(dir_fd: int, name: str) -> dict[str, object] | None:
    try:
        data = json.loads(read_bounded(dir_fd, name).decode("utf-8"))
    except (Skip, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def memory_erase(
    tiers: Sequence[StorageBackend], sections: Sequence[BackendSection], plugins: PluginManager
) -> Callable[[EraseMatch, bool], int]:
    """What an engine answers a request with: erase the match from each of ``tiers``
    that keeps chunks in the engine's memory pool (its section declares pool bytes,
    as for ``lmcache-core erase``); the count."""
    pool_tier = [plugins.pool_bytes(s) > 0 for s in sections]

    def erase(match: EraseMatch, dry_run: bool) -> int:
        return sum(t.erase(match, dry_run=dry_run) for t, mine in zip(tiers, pool_tier) if mine)

    return erase


def parse_request(data: dict[str, object], now: float) -> tuple[EraseMatch, bool] | None:
    """The match and dry-run flag of a request, or None when it is malformed, past its
    deadline or with a deadline no command sets (more than :data:`MAX_WAIT_S` ahead,
    not finite: a request that would never expire)."""
    until, dry, ids = data.get("until"), data.get("dry_run"), data.get("namespaces")
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not isinstance(dry, bool):
        return None
    if not now < until <= now + MAX_WAIT_S:  # NaN fails too
        return None
    if ids is None:
        return EraseMatch(None), dry
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_IDS:
        return None
    parsed = [namespace_of(x) if isinstance(x, str) else None for x in ids]
    if any(ns is None for ns in parsed):
        return None
    return EraseMatch(frozenset(ns for ns in parsed if ns is not None)), dry


class EngineControl:
    """One engine's presence in the control directory and its poller of erase
    requests: ``erase(match, dry_run)`` erases from the engine's memory tiers and
    says how many chunks. A directory that is refused (another user's, a link)
    disables it, with a warning: erase requests then do not reach this engine."""

    _serial = 0

    def __init__(
        self, control_dir: str | os.PathLike[str] | None, namespace: bytes, erase: Callable[[EraseMatch, bool], int]
    ) -> None:
        self.path = Path(control_dir) if control_dir is not None else default_dir()
        self.erase = erase
        EngineControl._serial += 1
        self.id = f"{os.getpid()}-{EngineControl._serial}"
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._fd = -1
        try:
            self._fd = open_private_dir(self.path, create=True)
            write_in_dir(self._fd, self.id + ENGINE, json.dumps({"pid": os.getpid(), "namespace": namespace.hex()}) + "\n")
        except (OSError, UnsafeDirError) as err:
            log.warning(
                "control directory %s not usable (%s): `lmcache-core erase` cannot reach this engine's CPU tier", self.path, err
            )
            self.close()
            return
        self._thread = threading.Thread(target=self._run, name="lmcache-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # never let the poller die over one bad request
                log.exception("control directory %s: an erase request failed", self.path)

    def poll(self) -> int:
        """Answer every new, valid request in the directory; how many were answered."""
        if self._fd < 0:
            return 0
        n = 0
        for name in _names(self._fd, REQUEST):
            if name in self._seen:
                continue
            if len(self._seen) >= MAX_ENTRIES:
                self._seen.clear()  # requests past their deadline are ignored anyway
            self._seen.add(name)
            data = _json(self._fd, name)
            req = parse_request(data, time.time()) if data is not None else None
            if req is None:
                continue
            answer: dict[str, object] = {"pid": os.getpid(), "engine": self.id}
            try:
                answer["chunks"] = erased = self.erase(*req)
                log.warning(
                    "erase request %s: %s %d chunks from this engine's memory tiers",
                    name,
                    "would erase" if req[1] else "erased",
                    erased,
                )
            except Exception as err:  # noqa: BLE001 - answered, so the command reports it
                answer["error"] = f"{type(err).__name__}: {err}"[:500]
                log.error("erase request %s failed: %s", name, answer["error"])
            write_in_dir(self._fd, f"{name[: -len(REQUEST)]}.{self.id}{DONE}", json.dumps(answer) + "\n")
            n += 1
        return n

    def close(self) -> None:
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * POLL_S)
        if self._fd >= 0:
            _unlink(self._fd, self.id + ENGINE)
            os.close(self._fd)
            self._fd = -1


@dataclass
class EngineAnswers:
    """What the running engines answered to one erase request."""

    chunks: dict[str, int] = field(default_factory=dict)  # engine id -> chunks
    silent: list[str] = field(default_factory=list)  # live engines that did not answer in time
    failed: dict[str, str] = field(default_factory=dict)  # engine id -> its error
    error: str | None = None  # the directory could not be used


def ask_engines(
    control_dir: str | os.PathLike[str] | None, match: EraseMatch, *, dry_run: bool, wait_s: float = WAIT_S
) -> EngineAnswers:
    """Ask every running engine that uses ``control_dir`` to erase ``match`` from its
    memory tiers, and collect the answers (see the module doc). ``wait_s``: more than
    0, at most :data:`MAX_WAIT_S` (else ValueError)."""
    if not 0 < wait_s <= MAX_WAIT_S:  # NaN fails too
        raise ValueError(f"wait_s must be more than 0 and at most {MAX_WAIT_S:g} seconds, got {wait_s!r}")
    path = Path(control_dir) if control_dir is not None else default_dir()
    try:
        fd = open_private_dir(path, create=False)
    except FileNotFoundError:
        return EngineAnswers()  # no engine of this user ever ran with it
    except (OSError, UnsafeDirError) as err:
        return EngineAnswers(error=f"control directory {path}: {err}")
    try:
        live = []
        for name in _names(fd, ENGINE):
            data = _json(fd, name)
            pid = data.get("pid") if data is not None else None
            if type(pid) is int and 0 < pid < 2**31 and pid_alive(pid):
                live.append(name[: -len(ENGINE)])
            elif data is not None:
                _unlink(fd, name)  # its engine is gone
        if not live:
            return EngineAnswers()
        rid = secrets.token_hex(8)
        ids = None if match.namespaces is None else sorted(n.hex() for n in match.namespaces)
        if ids is not None and len(ids) > MAX_IDS:
            return EngineAnswers(error=f"more than {MAX_IDS} namespaces in one request")
        until = time.time() + wait_s
        write_in_dir(fd, rid + REQUEST, json.dumps({"namespaces": ids, "dry_run": dry_run, "until": until}) + "\n")
        try:
            return _collect(fd, rid, live, until)
        finally:
            _unlink(fd, rid + REQUEST)
            for name in _names(fd, DONE):
                if name.startswith(rid + "."):
                    _unlink(fd, name)
    finally:
        os.close(fd)


def _collect(fd: int, rid: str, live: list[str], until: float) -> EngineAnswers:
    answers = EngineAnswers()
    while True:
        for engine in live:
            if engine not in answers.chunks and engine not in answers.failed:
                data = _json(fd, f"{rid}.{engine}{DONE}")
                chunks = data.get("chunks") if data is not None else None
                error = data.get("error") if data is not None else None
                if type(chunks) is int and chunks >= 0:
                    answers.chunks[engine] = chunks
                elif isinstance(error, str):
                    answers.failed[engine] = error[:500]
        if len(answers.chunks) + len(answers.failed) == len(live) or time.time() >= until:
            answers.silent = [e for e in live if e not in answers.chunks and e not in answers.failed]
            return answers
        time.sleep(POLL_S / 5)
