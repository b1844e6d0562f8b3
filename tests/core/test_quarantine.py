"""Tier quarantine (correctness canary): the mismatch window, control files, and the
engine skipping a quarantined tier for reads and writes.

Control files are trusted only from a directory of the engine's own user: the default
directory is private to the user (never another user's runtime dir), a new one is
0700 with 0600 files, and a directory owned by or writable by another user is
refused (by the engine and by ``lmcache-core quarantine``), leaving whatever it holds
untouched; another user cannot release a tier by deleting its file. The engine
replaces a link at a control file's name rather than following it and is never held
by a FIFO there. ``lmcache-core quarantine list`` reads in bounded time and memory
(planted FIFOs, links to ``/dev/zero``, 1 GiB files are skipped: exit 0, < 1 MiB
traced Python memory), skips control files with bad fields or oversized or deeply
nested JSON, and escapes control characters in what it prints.

"Another user" is uid/gid 65534: directories are chowned to it (tests that need root
skip cleanly otherwise), and deletion attempts run in a forked child that really
drops to that uid. Anything that could hang runs in a thread or child with a bounded
wait; the CLI runs in a forked child with at most 512 MiB more address space than
the parent had (so an unbounded read fails there, not here)."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from lmcache_core import metrics as m
from lmcache_core.cli import main as cli_main
from lmcache_core.plugins import PluginManager
from lmcache_core.quarantine import RECHECK_S, SUFFIX, MismatchWindow, Quarantine, default_dir, list_control_files
from lmcache_core.testing import ManualClock, MemoryTier
from lmcache_core.testing.tokens import lookup_tokens, store_tokens, token_hashes

from .helpers import TierPlugin
from .test_engine import SHAPE, engine, prepared


def test_window_counts_only_recent_mismatches() -> None:
    w = MismatchWindow(3, 60.0)
    assert not w.add(0.0) and not w.add(30.0)
    assert not w.add(61.0)  # the one at 0 fell out of the window: 2 left
    assert len(w) == 2
    assert w.add(89.0)  # 30, 61, 89 within 60 s
    with pytest.raises(ValueError):
        MismatchWindow(0, 1.0)


def test_window_memory_is_bounded() -> None:
    w = MismatchWindow(2, 1e9)
    for t in range(10_000):
        w.add(float(t))
    assert len(w) == 2


def test_quarantine_after_limit_then_release_by_deleting_control_file(tmp_path: Path) -> None:
    clock = ManualClock()
    changes: list[tuple[str, bool]] = []
    q = Quarantine(2, 10.0, tmp_path, clock=clock, on_change=lambda t, on: changes.append((t, on)))
    assert not q.record_mismatch("disk", "a")
    clock.now += 11  # outside the window: starts over
    assert not q.record_mismatch("disk", "b")
    assert not q.is_quarantined("disk") and q.mismatches("disk") == 1
    assert not q.record_mismatch("s3", "x")  # tiers are counted apart
    assert q.record_mismatch("disk", "c")
    assert q.is_quarantined("disk") and not q.is_quarantined("s3")
    assert changes == [("disk", True)]
    files = list_control_files(tmp_path)
    assert [f.tier for f in files] == ["disk"] and files[0].alive and "last: c" in files[0].reason
    # deleting the file releases the tier at the next check, not before
    files[0].path.unlink()
    assert q.is_quarantined("disk")
    clock.now += RECHECK_S
    assert not q.is_quarantined("disk")
    assert changes == [("disk", True), ("disk", False)]
    # counting starts over after a release
    assert not q.record_mismatch("disk")


def test_quarantine_without_a_writable_dir_holds_until_restart(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    clock = ManualClock()
    q = Quarantine(1, 10.0, blocker / "sub", clock=clock)
    assert q.record_mismatch("disk")
    clock.now += 100
    assert q.is_quarantined("disk")
    q.close()
    assert not q.is_quarantined("disk")


def test_cli_lists_and_releases(tmp_path: Path, capsys: Any) -> None:
    q = Quarantine(1, 10.0, tmp_path)
    q.record_mismatch("liar", "chunk k")
    assert cli_main(["quarantine", "list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "liar" in out and "yes" in out
    assert cli_main(["quarantine", "release", "other", "--dir", str(tmp_path)]) == 1
    # the options before the tier's name, or before the action, as docs/canary.md writes them
    assert cli_main(["quarantine", "release", "--dir", str(tmp_path), "liar"]) == 0
    assert list_control_files(tmp_path) == []
    q.record_mismatch("liar2", "chunk k")
    assert len(list_control_files(tmp_path)) == 1
    assert cli_main(["quarantine", "--dir", str(tmp_path), "release", "--all"]) == 0
    assert list_control_files(tmp_path) == []
    assert cli_main(["quarantine", "release", "--all", "--dir", str(tmp_path)]) == 1
    assert "no quarantined tier in" in capsys.readouterr().err
    q.close()


def test_default_dir_flow_list_and_release_by_cli(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """Negative control for the ownership checks: with no quarantine_dir, an engine and the
    CLI of the same user meet in the private default directory, and a release by
    the CLI puts the tier back in service at the engine's next check."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    for var in ("LMCACHE_CORE_CONFIG", "LMCACHE_CORE_QUARANTINE_DIR"):
        monkeypatch.delenv(var, raising=False)
    clock = ManualClock()
    q = Quarantine(1, 10.0, clock=clock)
    assert q.record_mismatch("disk", "chunk k")
    d = runtime / "lmcache-core-quarantine"
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700 and len(list_control_files(d)) == 1
    assert cli_main(["quarantine", "list"]) == 0
    out = capsys.readouterr().out
    assert "disk" in out and "chunk k" in out
    assert cli_main(["quarantine", "release", "disk"]) == 0
    assert "released tier disk" in capsys.readouterr().out and list_control_files(d) == []
    assert q.is_quarantined("disk")  # noticed at the next check
    clock.now += RECHECK_S
    assert not q.is_quarantined("disk")
    q.close()


def test_an_existing_dir_only_we_can_write_is_used(tmp_path: Path) -> None:
    """A configured directory that is ours and writable by us only (0755 here) is
    accepted as it is; the CLI lists what the engine wrote."""
    d = tmp_path / "q"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    q = Quarantine(1, 10.0, d)
    assert q.record_mismatch("disk")
    assert [f.tier for f in list_control_files(d)] == ["disk"]
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o755  # not changed behind the operator's back
    q.close()


def test_engine_with_a_refused_dir_quarantines_in_memory(tmp_path: Path) -> None:
    """A quarantine_dir others can write is refused; the tier is quarantined all the
    same (kept in memory until restart) and nothing is written there."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    plugin = TierPlugin()
    backends = [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}]
    with engine(backends, plugin, verify_mismatch_limit=1, quarantine_dir=str(d)) as eng:
        assert eng.quarantine.record_mismatch("dict_tier")
        eng.quarantine._held["dict_tier"].checked -= 100 * RECHECK_S
        assert eng.stats()["quarantined"] == ["dict_tier"]
        assert os.listdir(d) == []


def _lie(tier: MemoryTier) -> None:
    """Make every object in ``tier`` another key's object (a valid, wrong chunk)."""
    keys = list(tier.data)
    vals = [tier.data[k] for k in keys]
    for k, v in zip(keys, vals[1:] + vals[:1]):
        tier.plant(k, v)


def _exact(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    return bool(torch.equal(a, b)), "compared"


def test_engine_verify_charges_origin_replaces_and_quarantines(tmp_path: Path) -> None:
    plugin = TierPlugin()
    backends = [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}]
    with engine(backends, plugin, verify_mismatch_limit=2, quarantine_dir=str(tmp_path)) as eng:
        tier0, tier1 = eng.tiers
        toks, chunks, keys = prepared(eng, 1, 3)
        hashes = token_hashes(eng, toks)
        store_tokens(eng, toks, chunks)
        assert eng.flush(10)
        # all copies right: no mismatch
        v = eng.canary.verify(hashes[0], chunks[0], _exact)
        assert [(x.tier, x.equal) for x in v] == [("local_cpu", True), ("dict_tier", True)]
        # the slower tier lies; tier 0 lost the chunks, so a retrieve promotes a lie
        _lie(tier1)
        for k in keys:
            tier0.remove(k)
        out = torch.empty(SHAPE, dtype=torch.float16)
        assert eng.retrieve_hashes(hashes[:1], [out]) == 1 and not torch.equal(out, chunks[0])
        before = m.VERIFY_MISMATCHES.labels("dict_tier")._value.get()
        v = eng.canary.verify(hashes[0], chunks[0], _exact)
        # both copies differ; both are the slower tier's fault (tier 0's came from it)
        assert [(x.tier, x.blame, x.equal) for x in v] == [("local_cpu", "dict_tier", False), ("dict_tier", "dict_tier", False)]
        assert eng.stats()["verify_mismatches"] == {"dict_tier": 1}
        assert m.VERIFY_MISMATCHES.labels("dict_tier")._value.get() == before + 1
        # both copies were replaced by the fresh chunk
        assert torch.equal(tier1.data[keys[0]], chunks[0])
        assert eng.retrieve_hashes(hashes[:1], [out]) == 1 and torch.equal(out, chunks[0])
        assert eng.quarantine.quarantined() == []
        # a second mismatch within the window quarantines the liar
        eng.canary.verify(hashes[1], chunks[1], _exact)
        assert eng.stats()["quarantined"] == ["dict_tier"]
        # the copy whose mismatch took the tier out of service was repaired first
        assert torch.equal(tier1.data[keys[1]], chunks[1])
        assert m.TIER_QUARANTINED.labels("dict_tier")._value.get() == 1
        # no reads from it: chunk 2 (a lie, only there) is a miss now
        assert eng.lookup_hashes(hashes[2:]) == 0
        assert eng.retrieve_hashes(hashes[2:], [out]) == 0
        # no writes to it
        puts = tier1.stats().puts
        toks2, chunks2, _ = prepared(eng, 2, 2)
        store_tokens(eng, toks2, chunks2)
        assert eng.flush(10) and tier1.stats().puts == puts
        assert lookup_tokens(eng, toks2) == len(toks2)  # tier 0 still serves
        # released by an operator (control file deleted)
        for f in list_control_files(tmp_path):
            f.path.unlink()
        eng.quarantine._held["dict_tier"].checked -= RECHECK_S
        assert eng.quarantine.quarantined() == []
        assert m.TIER_QUARANTINED.labels("dict_tier")._value.get() == 0
        # back in service, it serves the repaired copy, never the one the canary caught
        assert eng.retrieve_hashes(hashes[1:2], [out]) == 1 and torch.equal(out, chunks[1])
    assert list_control_files(tmp_path) == []


def test_quarantined_first_tier_still_writes_behind(tmp_path: Path) -> None:
    plugin = TierPlugin()
    backends = [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "dict_tier"}]
    with engine(backends, plugin, verify_mismatch_limit=1, quarantine_dir=str(tmp_path)) as eng:
        tier0, tier1 = eng.tiers
        eng.quarantine.record_mismatch("local_cpu")
        toks, chunks, keys = prepared(eng, 3, 2)
        assert store_tokens(eng, toks, chunks) == 0
        assert eng.flush(10)
        assert tier0.contains(keys) == 0 and tier1.contains(keys) == 2
        assert lookup_tokens(eng, toks) == len(toks)


# -- control files against another local user --------------------------------------------


OTHER = 65534  # "another local user" (nobody)
VICTIM_TEXT = b"root:x:0:0:the victim file, it must stay unchanged\n"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user needs root (chown, setuid)")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp that another user can traverse (pytest's tmp_path is
    under a 0700 directory: a foreign child could not reach anything in it, and a
    test could pass for the wrong reason)."""
    d = Path(tempfile.mkdtemp(prefix="qh-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _victim(where: Path) -> Path:
    v = where / "victim"
    v.write_bytes(VICTIM_TEXT)
    return v


def _control_name(q: Quarantine, tier: str) -> str:
    return f"{tier}.{q._id}{SUFFIX}"  # the name the engine will write (old and new code)


def _as_other_user(fn: Callable[[], int], timeout_s: float = 30.0) -> int:
    """Run ``fn`` in a forked child that dropped to uid/gid 65534; its exit status."""
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            code = fn()
        except BaseException:  # noqa: BLE001 - the status says it failed
            code = 98
        finally:
            os._exit(code)
    return _wait(pid, timeout_s)


def _wait(pid: int, timeout_s: float) -> int:
    """The child's exit status, or -1 after killing it at ``timeout_s`` (bounded loop)."""
    for _ in range(int(timeout_s / 0.02) + 1):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


def _delete_everything_in(d: Path) -> Callable[[], int]:
    """The attacker's move: delete every entry of ``d``; 0 if it deleted any, 1 if it
    could list nothing, 2 if it listed entries but could delete none."""

    def attack() -> int:
        try:
            names = os.listdir(d)
        except OSError:
            return 1
        deleted = 0
        for n in names:
            try:
                os.unlink(d / n)
                deleted += 1
            except OSError:
                pass
        return 0 if deleted else 2

    return attack


# -- where the control files go --------------------------------------------------------
def test_default_dir_is_private_to_the_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old default, ``<tmp>/lmcache-core-quarantine``, was one name for every user."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert default_dir() == Path(tempfile.gettempdir()) / f"lmcache-core-quarantine-{os.geteuid()}"
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_dir() == runtime / "lmcache-core-quarantine"
    # A runtime dir others can write (or a relative one) is not used.
    os.chmod(runtime, 0o777)
    assert default_dir() == Path(tempfile.gettempdir()) / f"lmcache-core-quarantine-{os.geteuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/run")
    assert default_dir().name == f"lmcache-core-quarantine-{os.geteuid()}"


@root_only
def test_default_dir_ignores_another_users_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, OTHER, OTHER)  # e.g. sudo kept the invoking user's XDG_RUNTIME_DIR
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_dir() == Path(tempfile.gettempdir()) / f"lmcache-core-quarantine-{os.geteuid()}"


def test_a_new_control_dir_is_0700_and_files_0600(tmp_path: Path) -> None:
    d = tmp_path / "a" / "quarantine"
    q = Quarantine(1, 10.0, d)
    assert q.record_mismatch("disk")
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    (f,) = list_control_files(d)
    fst = os.lstat(f.path)
    assert stat.S_ISREG(fst.st_mode) and stat.S_IMODE(fst.st_mode) == 0o600
    assert os.listdir(d) == [f.path.name]  # no temporary file left behind
    q.close()
    assert os.listdir(d) == []


# -- a directory another user prepared ---------------------------------------------------
def _foreign_dir(shared: Path, kind: str) -> Path:
    """The control directory as an attacker prepared it, before the engine runs."""
    d = shared / "lmcache-core-quarantine"
    if kind == "symlink":
        theirs = shared / "theirs"
        theirs.mkdir(mode=0o777)
        os.chmod(theirs, 0o777)
        os.chown(theirs, OTHER, OTHER)
        d.symlink_to(theirs)
        return d
    d.mkdir()
    if kind == "foreign-owned":
        os.chmod(d, 0o755)
        os.chown(d, OTHER, OTHER)
    else:  # ours, but anyone may write it
        os.chmod(d, 0o777)
    return d


@root_only
@pytest.mark.parametrize("kind", ["foreign-owned", "world-writable", "symlink"])
def test_foreign_dir_is_refused_and_symlinked_victim_unchanged(
    shared_tmp: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    d = _foreign_dir(shared_tmp, kind)
    victim = _victim(shared_tmp)
    before = os.stat(victim)
    clock = ManualClock()
    q = Quarantine(1, 10.0, d, clock=clock)
    link = d / _control_name(q, "disk")
    link.symlink_to(victim)
    assert os.path.realpath(link) == str(victim)  # positive control: the link reaches the victim
    with caplog.at_level(logging.ERROR, logger="lmcache_core.quarantine"):
        assert q.record_mismatch("disk", "chunk k")
    assert victim.read_bytes() == VICTIM_TEXT and os.stat(victim).st_mtime_ns == before.st_mtime_ns
    assert link.is_symlink()
    assert "quarantine_dir refused" in caplog.text and "kept in memory only" in caplog.text, caplog.text
    # Nothing of ours is in their directory, and the quarantine holds whatever they do.
    assert [n for n in os.listdir(d) if os.lstat(d / n).st_uid == os.geteuid() and n != link.name] == []
    for n in os.listdir(d):
        os.unlink(d / n)
    clock.now += 100 * RECHECK_S
    assert q.is_quarantined("disk") and q.quarantined() == ["disk"]
    q.close()
    assert victim.read_bytes() == VICTIM_TEXT


@root_only
def test_another_user_cannot_release_a_tier(shared_tmp: Path) -> None:
    """Attack as the review describes it: the attacker pre-created the shared
    directory and deletes the engine's control file. The old code wrote the file into
    their directory, and the tier was back in service a second later."""
    d = _foreign_dir(shared_tmp, "world-writable")
    os.chown(d, OTHER, OTHER)
    clock = ManualClock()
    q = Quarantine(1, 10.0, d, clock=clock)
    assert q.record_mismatch("disk")
    _as_other_user(_delete_everything_in(d))
    clock.now += RECHECK_S
    assert q.is_quarantined("disk")
    q.close()

    # A private directory of ours: the foreign user can neither list nor delete.
    mine = shared_tmp / "mine"
    q2 = Quarantine(1, 10.0, mine, clock=clock)
    assert q2.record_mismatch("disk")
    (f,) = list_control_files(mine)
    assert _as_other_user(_delete_everything_in(mine)) == 1
    assert _as_other_user(lambda: 0 if _try_unlink(f.path) else 3) == 3
    assert f.path.exists()
    clock.now += RECHECK_S
    assert q2.is_quarantined("disk")
    # Positive control: the same child deletes a file where it may (a 0777 dir).
    open_dir = shared_tmp / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    (open_dir / "x").write_text("x")
    assert _as_other_user(_delete_everything_in(open_dir)) == 0 and not (open_dir / "x").exists()
    # Negative control: the owner releases by deleting the file.
    f.path.unlink()
    clock.now += RECHECK_S
    assert not q2.is_quarantined("disk")
    q2.close()


def _try_unlink(p: Path) -> bool:
    try:
        os.unlink(p)
    except OSError:
        return False
    return True


def test_a_dir_that_becomes_writable_by_others_stops_counting_deletions(tmp_path: Path) -> None:
    """Once others can write the directory, a deletion no longer says who released."""
    clock = ManualClock()
    d = tmp_path / "q"
    q = Quarantine(1, 10.0, d, clock=clock)
    assert q.record_mismatch("disk")
    os.chmod(d, 0o777)
    clock.now += RECHECK_S
    assert q.is_quarantined("disk")  # noticed here: the file no longer counts
    assert list_control_files(d) == []  # and the CLI refuses the directory
    for p in d.iterdir():
        p.unlink()
    clock.now += RECHECK_S
    assert q.is_quarantined("disk")
    q.close()


# -- links and FIFOs planted under the control file's name -----------------------------
def test_symlink_in_own_dir_is_replaced_not_followed(tmp_path: Path) -> None:
    d = tmp_path / "q"
    d.mkdir(mode=0o700)
    victim = _victim(tmp_path)
    q = Quarantine(1, 10.0, d)
    link = d / _control_name(q, "disk")
    link.symlink_to(victim)
    assert q.record_mismatch("disk")
    assert victim.read_bytes() == VICTIM_TEXT
    assert not link.is_symlink() and link.is_file()  # replaced by our control file
    assert [f.tier for f in list_control_files(d)] == ["disk"]
    q.close()
    assert victim.read_bytes() == VICTIM_TEXT


def test_fifo_at_control_name_does_not_block_the_engine(tmp_path: Path) -> None:
    """The old code opened the FIFO for writing: it blocked (holding the quarantine
    lock) until someone read it."""
    d = tmp_path / "q"
    d.mkdir(mode=0o700)
    q = Quarantine(1, 10.0, d)
    fifo = d / _control_name(q, "disk")
    os.mkfifo(fifo)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(q.record_mismatch("disk")), daemon=True)
    t.start()
    t.join(10.0)
    blocked = t.is_alive()
    if blocked:  # let the old code's writer go: open the other end, then close it
        rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        t.join(10.0)
        os.close(rfd)
    assert not blocked, "record_mismatch blocked on a FIFO planted under the control file's name"
    assert result == [True] and q.is_quarantined("disk")
    assert stat.S_ISREG(os.lstat(fifo).st_mode) and [f.tier for f in list_control_files(d)] == ["disk"]
    q.close()


# -- the CLI reading a directory with planted entries -----------------------------------
_PM: list[PluginManager] = []


def _cli_bounded(argv: list[str], tmp: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """``lmcache-core`` in a forked child, bounded in time (killed at ``timeout_s``)
    and memory (512 MiB more address space than this process); its exit status,
    stdout, stderr and the peak Python memory it traced."""
    if not _PM:
        _PM.append(PluginManager())
    pm = _PM[0]
    out, err, peak = tmp / "cli.out", tmp / "cli.err", tmp / "cli.peak"
    for p in (out, err, peak):
        p.unlink(missing_ok=True)
    vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    pid = os.fork()
    if pid == 0:  # child
        code = 70
        try:
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
            sys.stdout = open(out, "w", encoding="utf-8")
            sys.stderr = open(err, "w", encoding="utf-8")
            tracemalloc.start()
            code = cli_main(argv, plugin_manager=pm)
            peak.write_text(str(tracemalloc.get_traced_memory()[1]))
        except BaseException:  # noqa: BLE001 - reported through the files
            try:
                sys.stderr.write(traceback.format_exc())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except BaseException:  # noqa: BLE001
                    pass
            os._exit(code)
    rc = _wait(pid, timeout_s)
    return {
        "rc": rc,
        "out": out.read_text() if out.exists() else "",
        "err": err.read_text() if err.exists() else "",
        "peak": int(peak.read_text()) if peak.exists() else None,
    }


def _plant(d: Path, kind: str, victim: Path) -> str:
    """One hostile entry under a control-file name; the name."""
    name = f"{kind}.1-1{SUFFIX}"
    p = d / name
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "devzero":
        p.symlink_to("/dev/zero")
    elif kind == "huge":
        with open(p, "wb") as f:
            f.truncate(1 << 30)  # sparse: 1 GiB to read, no disk used
    elif kind == "link-to-victim":
        victim.write_text(json.dumps({"tier": "leaked", "pid": 1, "since": 0, "reason": "read through a link"}))
        p.symlink_to(victim)
    return name


@pytest.mark.parametrize(
    "kind, why",
    [
        ("fifo", "not a regular file"),
        ("devzero", "symbolic link"),
        ("huge", "too large (1073741824 bytes"),
        ("link-to-victim", "symbolic link"),
    ],
)
def test_cli_list_skips_planted_entries_in_bounded_time_and_memory(tmp_path: Path, kind: str, why: str) -> None:
    d = tmp_path / "q"
    q = Quarantine(1, 10.0, d)
    assert q.record_mismatch("real", "chunk k")  # positive control: listed next to the planted entry
    name = _plant(d, kind, _victim(tmp_path))
    res = _cli_bounded(["quarantine", "list", "--dir", str(d)], tmp_path)
    print(kind, {k: v for k, v in res.items() if k != "out"})
    assert res["rc"] == 0, res
    assert "real" in res["out"] and "leaked" not in res["out"], res
    assert f"warning: skipped {name}: " in res["err"] and why in res["err"], res
    assert res["peak"] is not None and res["peak"] < 1 << 20, res
    # release --all deletes the engine's file only; the planted entry stays as it was
    res = _cli_bounded(["quarantine", "release", "--all", "--dir", str(d)], tmp_path)
    assert res["rc"] == 0 and "released tier real" in res["out"], res
    assert os.listdir(d) == [name]
    q.close()


@root_only
def test_cli_refuses_a_foreign_dir(shared_tmp: Path) -> None:
    """A directory another user owns or can write: its entries are theirs, not an
    engine's (the old CLI listed them, and `release` acted on them)."""
    d = _foreign_dir(shared_tmp, "foreign-owned")
    (d / f"fake.1-1{SUFFIX}").write_text(json.dumps({"tier": "fake", "pid": 1, "since": 0, "reason": "planted"}))
    res = _cli_bounded(["quarantine", "list", "--dir", str(d)], shared_tmp)
    assert res["rc"] == 2 and "fake" not in res["out"], res
    assert "refusing the control directory" in res["err"] and f"owned by uid {OTHER}" in res["err"], res
    res = _cli_bounded(["quarantine", "release", "--all", "--dir", str(d)], shared_tmp)
    assert res["rc"] == 2 and (d / f"fake.1-1{SUFFIX}").exists(), res
    # Negative control: the same entry in a private directory of ours is listed.
    os.chown(d, 0, 0)
    os.chmod(d, 0o700)
    res = _cli_bounded(["quarantine", "list", "--dir", str(d)], shared_tmp)
    assert res["rc"] == 0 and "fake" in res["out"], res


@pytest.mark.parametrize(
    "fields",
    [
        {"tier": "t", "pid": 10**30, "since": 0, "reason": "r"},  # os.kill: OverflowError
        {"tier": "t", "pid": 1, "since": float("nan"), "reason": "r"},  # localtime: ValueError
        {"tier": "t", "pid": 1, "since": 1e300, "reason": "r"},  # localtime: OverflowError
        {"tier": "t", "pid": True, "since": 0, "reason": "r"},  # a bool is no pid
        {"tier": ["t"], "pid": 1, "since": 0, "reason": "r"},  # was shown as "['t']"
    ],
)
def test_cli_skips_control_files_with_bad_fields(tmp_path: Path, fields: dict[str, Any], capsys: Any) -> None:
    d = tmp_path / "q"
    d.mkdir(mode=0o700)
    (d / f"bad.1-1{SUFFIX}").write_text(json.dumps(fields))
    assert cli_main(["quarantine", "list", "--dir", str(d)]) == 0
    cap = capsys.readouterr()
    assert "no quarantined tiers" in cap.out and f"skipped bad.1-1{SUFFIX}: has no valid" in cap.err


def test_cli_skips_deeply_nested_or_oversized_json(tmp_path: Path, capsys: Any) -> None:
    d = tmp_path / "q"
    d.mkdir(mode=0o700)
    (d / f"deep.1-1{SUFFIX}").write_text("[" * 50_000 + "]" * 50_000)  # 100 kB: over the size cap
    (d / f"nest.1-1{SUFFIX}").write_text("[" * 30_000)  # under the cap, nested past the recursion limit
    assert cli_main(["quarantine", "list", "--dir", str(d)]) == 0
    cap = capsys.readouterr()
    assert "no quarantined tiers" in cap.out
    assert f"skipped deep.1-1{SUFFIX}: is too large (100000 bytes" in cap.err
    assert f"skipped nest.1-1{SUFFIX}: is not valid JSON" in cap.err


def test_cli_escapes_control_characters(tmp_path: Path, capsys: Any) -> None:
    d = tmp_path / "q"
    q = Quarantine(1, 10.0, d)
    ansi = "\x1b[2J\x1b]0;owned\x07\r\nnext line\u202egnp"
    assert q.record_mismatch("disk", ansi)  # in the reason the engine writes
    (d / f"x.1-1{SUFFIX}").write_text(json.dumps({"tier": "\x1b[31mred", "pid": 1, "since": 0, "reason": ansi}))
    (d / f"\x1b[5m.1-1{SUFFIX}").symlink_to("/dev/null")  # and in a skipped file's name
    assert cli_main(["quarantine", "list", "--dir", str(d)]) == 0
    cap = capsys.readouterr()
    for text in (cap.out, cap.err):
        assert not any(ord(c) < 32 and c != "\n" or c == "\x7f" or c == "\u202e" for c in text), repr(text)
    assert cap.out.count("\n") == 3  # header and two rows: the \r\n in a reason is shown, not obeyed
    assert "\\x1b[2J\\x1b]0;owned\\x07\\r\\nnext line\\u202egnp" in cap.out
    assert "\\x1b[31mred" in cap.out and "skipped \\x1b[5m.1-1" in cap.err
    assert cli_main(["quarantine", "release", "\x1b[31mred", "--dir", str(d)]) == 0
    cap = capsys.readouterr()
    assert "\x1b" not in cap.out and "released tier \\x1b[31mred of pid 1" in cap.out
    q.close()
