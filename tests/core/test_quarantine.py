"""Tier quarantine (correctness canary): the mismatch window, control files, and the
engine skipping a quarantined tier for reads and writes."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import metrics as m
from lmcache_core.cli import main as cli_main
from lmcache_core.quarantine import RECHECK_S, MismatchWindow, Quarantine, list_control_files
from lmcache_core.testing import MemoryTier
from lmcache_core.testing.tokens import lookup_tokens, store_tokens, token_hashes

from .helpers import TierPlugin
from .test_engine import SHAPE, engine, prepared


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
    clock = Clock()
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
    clock = Clock()
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
    assert cli_main(["quarantine", "release", "liar", "--dir", str(tmp_path)]) == 0
    assert list_control_files(tmp_path) == []
    q.close()


def test_default_dir_flow_list_and_release_by_cli(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """Negative control for the hardening: with no quarantine_dir, an engine and the
    CLI of the same user meet in the private default directory, and a release by
    the CLI puts the tier back in service at the engine's next check."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    for var in ("LMCACHE_CORE_CONFIG", "LMCACHE_CORE_QUARANTINE_DIR"):
        monkeypatch.delenv(var, raising=False)
    clock = Clock()
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
