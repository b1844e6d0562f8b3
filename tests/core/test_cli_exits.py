"""How every command ends when its reader or its user goes away: a closed stdout
(``lmcache-core config | head``) ends it quietly with 141, Ctrl-C with 130 and one
line; never a traceback. Real processes; the pipe's read end is closed before the
command writes, so the broken pipe is certain, not a race."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

CLI = [sys.executable, "-m", "lmcache_core.cli"]


def test_a_reader_that_went_away_ends_the_command_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write fails
    try:
        p = subprocess.run([*CLI, "config"], stdout=write, stderr=subprocess.PIPE, timeout=120, text=True)
    finally:
        os.close(write)
    assert p.returncode == 141 and "Traceback" not in p.stderr, p.stderr
    # control: with a reader the same command succeeds and prints the config
    ok = subprocess.run([*CLI, "config"], capture_output=True, timeout=120, text=True)
    assert ok.returncode == 0 and "chunk_size" in ok.stdout


def test_ctrl_c_ends_the_command_with_130_and_one_line(tmp_path: Path) -> None:
    """An erase waiting for a running engine that never answers (an engine file naming
    this test's own, live, pid) is interrupted."""
    control = tmp_path / "control"
    control.mkdir(mode=0o700)
    (control / f"{os.getpid()}-1.engine").write_text(json.dumps({"pid": os.getpid()}))
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(yaml.safe_dump({"backends": [{"name": "local_cpu"}], "quarantine_dir": str(control)}))
    args = [*CLI, "erase", "--config", str(cfg), "--all", "--dry-run", "--engines-wait-s", "60"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(n.endswith(".erase") for n in os.listdir(control)) and time.monotonic() < deadline:
            time.sleep(0.05)  # asking the engines now
        assert any(n.endswith(".erase") for n in os.listdir(control)), "the command never asked"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 130 and err.strip() == "interrupted", err
    assert not any(n.endswith(".erase") for n in os.listdir(control))  # its request was taken back
