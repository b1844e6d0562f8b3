"""``lmcache-core erase`` reaches the CPU tier inside running engines through the
control directory (:mod:`lmcache_core.control`): engines announce themselves and
answer erase requests; the command sums their counts, waits a bounded time, and
reports an engine that does not answer as a partial erase.

Real engines (CacheEngine with a CPU tier, their poll threads) and the real command;
the control directory is the config's ``quarantine_dir`` in tmp_path. Negative
controls: the other engine's namespace survives; a dry run erases nothing; a request
past its deadline, malformed or hostile files are ignored."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_core import CacheEngine, KeyNamespace, cli
from lmcache_core.config import load_config
from lmcache_core.control import DONE, ENGINE, MAX_WAIT_S, REQUEST, EngineControl, ask_engines, parse_request
from lmcache_core.backend import EraseMatch
from lmcache_core.plugins import PluginManager
from lmcache_core.testing.tokens import store_tokens

from .test_engine import CS, chunks_for, prompt

A = KeyNamespace(model="model-a", layout="test", dtype="float16")
B = KeyNamespace(model="model-b", layout="test", dtype="float16")


def _engine(control: Path, ns: KeyNamespace) -> CacheEngine:
    pm = PluginManager(load_entry_points=False)
    over = {"chunk_size": CS, "backends": [{"name": "local_cpu", "max_size": "4MiB"}], "quarantine_dir": str(control)}
    return CacheEngine(load_config(env={}, overrides=over), namespace=ns, plugins=pm)


def _config(tmp_path: Path, control: Path) -> Path:
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(yaml.safe_dump({"chunk_size": CS, "backends": [{"name": "local_cpu"}], "quarantine_dir": str(control)}))
    return cfg


def _erase(cfg: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = cli.main(["erase", "--config", str(cfg), *args], plugin_manager=PluginManager(load_entry_points=False))
    return rc, capsys.readouterr().out


def _row(out: str) -> str:
    line = next(x for x in out.splitlines() if x.startswith("backends[0]"))
    return " ".join(line.split()[2:4])


def test_erase_reaches_the_cpu_tier_of_running_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    control = tmp_path / "control"
    a, b = _engine(control, A), _engine(control, B)
    try:
        toks = prompt(1, 4)
        assert store_tokens(a, toks, chunks_for(toks)) == 4 and store_tokens(b, toks, chunks_for(toks)) == 4
        cfg = _config(tmp_path, control)
        rc, out = _erase(cfg, capsys, "--namespace", a.namespace.id.hex(), "--dry-run")
        assert rc == 0 and _row(out) == "would-erase 4", out
        assert len(a.tiers[0]._entries) == 4  # noqa: SLF001 - a dry run erases nothing
        rc, out = _erase(cfg, capsys, "--namespace", a.namespace.id.hex())
        assert rc == 0 and _row(out) == "erased 4", out
        assert "in 2 running engine(s)" in out, out
        assert len(a.tiers[0]._entries) == 0  # noqa: SLF001
        assert len(b.tiers[0]._entries) == 4  # noqa: SLF001 - the control: the other namespace stays
        rc, out = _erase(cfg, capsys, "--all")
        assert rc == 0 and _row(out) == "erased 4" and len(b.tiers[0]._entries) == 0, out  # noqa: SLF001
    finally:
        a.close()
        b.close()
    assert not [n for n in os.listdir(control) if n.endswith((ENGINE, REQUEST, DONE))]  # all cleaned up
    rc, out = _erase(cfg, capsys, "--all")
    assert rc == 0 and _row(out) == "erased 0" and "no running engine" in out, out


def test_an_engine_that_does_not_answer_makes_the_erase_partial(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A live process announced as an engine that never polls: exit 1, named; a stale
    announcement (its process is gone) is removed and ignored."""
    control = tmp_path / "control"
    control.mkdir(mode=0o700)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (control / f"{sleeper.pid}-1{ENGINE}").write_text(json.dumps({"pid": sleeper.pid, "namespace": "00" * 16}))
        (control / f"{dead.pid}-1{ENGINE}").write_text(json.dumps({"pid": dead.pid, "namespace": "00" * 16}))
        cfg = _config(tmp_path, control)
        t0 = time.monotonic()
        rc, out = _erase(cfg, capsys, "--all", "--engines-wait-s", "1")
        assert time.monotonic() - t0 < 10
        assert rc == 1 and _row(out).startswith("FAILED"), out
        assert f"engine {sleeper.pid}-1 did not answer within 1 s" in out, out
        assert f"{dead.pid}-1" not in out and not (control / f"{dead.pid}-1{ENGINE}").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_requests_past_their_deadline_or_malformed_are_ignored(tmp_path: Path) -> None:
    control = tmp_path / "control"
    calls: list[Any] = []
    c = EngineControl(control, b"\0" * 16, lambda m, d: calls.append((m, d)) or 7)
    try:
        now = time.time()
        assert parse_request({"namespaces": None, "dry_run": False, "until": now - 1}, now) is None
        assert parse_request({"namespaces": ["zz"], "dry_run": False, "until": now + 5}, now) is None
        assert parse_request({"namespaces": [], "dry_run": False, "until": now + 5}, now) is None
        assert parse_request({"namespaces": None, "dry_run": "no", "until": now + 5}, now) is None
        # a deadline no command sets: a request that would never (or not for long) expire
        for until in (float("inf"), float("nan"), now + MAX_WAIT_S + 1):
            assert parse_request({"namespaces": None, "dry_run": False, "until": until}, now) is None, until
        assert parse_request({"namespaces": None, "dry_run": False, "until": now + MAX_WAIT_S}, now) is not None
        assert parse_request({"namespaces": ["ab" * 16], "dry_run": True, "until": now + 5}, now) == (
            EraseMatch(frozenset([bytes.fromhex("ab" * 16)])),
            True,
        )
        (control / f"old{REQUEST}").write_text(json.dumps({"namespaces": None, "dry_run": False, "until": now - 1}))
        (control / f"never{REQUEST}").write_text('{"namespaces": null, "dry_run": false, "until": Infinity}')
        (control / f"junk{REQUEST}").write_text("{not json")
        (control / f"big{REQUEST}").write_bytes(b" " * (1 << 20))
        os.mkfifo(control / f"fifo{REQUEST}")
        os.symlink(control / f"old{REQUEST}", control / f"link{REQUEST}")
        assert c.poll() == 0 and calls == []
        # the control: a valid request is answered (once)
        (control / f"ok{REQUEST}").write_text(json.dumps({"namespaces": None, "dry_run": False, "until": now + 30}))
        assert c.poll() == 1 and c.poll() == 0 and len(calls) == 1
        answer = json.loads((control / f"ok.{c.id}{DONE}").read_text())
        assert answer["chunks"] == 7
    finally:
        c.close()


def test_a_control_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir(mode=0o777)
    os.chmod(control, 0o777)
    c = EngineControl(control, b"\0" * 16, lambda m, d: 0)
    assert c.poll() == 0 and not list(control.iterdir())  # nothing announced there
    c.close()
    answers = ask_engines(control, EraseMatch(None), dry_run=False, wait_s=0.5)
    assert answers.error is not None and "writable by group or others" in answers.error, answers


@pytest.mark.parametrize("wait", ["nan", "inf", "-1", "0", "601", "soon"])
def test_engines_wait_must_be_a_finite_bounded_number(tmp_path: Path, capsys: pytest.CaptureFixture[str], wait: str) -> None:
    """NaN or infinity waited forever for a silent engine and left a request that never
    expired; the flag is refused before anything is asked (exit 2, one line)."""
    cfg = _config(tmp_path, tmp_path / "control")
    with pytest.raises(SystemExit) as e:
        cli.main(
            ["erase", "--config", str(cfg), "--all", "--engines-wait-s", wait],
            plugin_manager=PluginManager(load_entry_points=False),
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--engines-wait-s" in err and "Traceback" not in err, err
    assert not (tmp_path / "control").exists() or not list((tmp_path / "control").iterdir())
    with pytest.raises(ValueError):
        ask_engines(tmp_path / "control", EraseMatch(None), dry_run=True, wait_s=float(wait) if wait != "soon" else math.nan)
