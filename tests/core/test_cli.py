"""Acceptance 8: the ``lmcache-core`` console script, run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .helpers import BROKEN_PLUGIN_SRC, make_distribution

SCRIPT = Path(sys.executable).with_name("lmcache-core")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if not SCRIPT.exists():
        pytest.fail(f"console script {SCRIPT} is not installed (pip install -e .)")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_CORE_")}
    full_env.update(env or {})
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=120)


def rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    out = {}
    for line in stdout.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[0] in ("backend", "codec"):
            out[(cols[0], cols[1])] = cols[2:4]
    return out


def test_plugins_lists_backends_and_codecs_with_origin() -> None:
    res = run("plugins")
    assert res.returncode == 0, res.stderr
    table = rows(res.stdout)
    assert table[("backend", "local_cpu")] == ["lmcache-core", "0.1.0"]
    assert table[("backend", "example_dict")] == ["lmcache-backend-example", "0.1.0"]
    assert table[("codec", "raw")][0] == table[("codec", "lz4")][0] == "lmcache-core"


def test_plugins_reports_a_broken_distribution(tmp_path: Path) -> None:
    mod = f"cli_broken_{uuid.uuid4().hex[:8]}"
    make_distribution(tmp_path, "cli-broken-plugin", "3.1", {"clibroken": mod}, {mod: BROKEN_PLUGIN_SRC})
    res = run("plugins", env={"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 1
    assert "cli-broken-plugin 3.1" in res.stdout and ("backend", "example_dict") in rows(res.stdout)
    blocked = run("plugins", env={"PYTHONPATH": str(tmp_path), "LMCACHE_CORE_BLOCK_PLUGINS": "cli-broken-plugin"})
    assert blocked.returncode == 0 and "blocked by LMCACHE_CORE_BLOCK_PLUGINS: cli-broken-plugin" in blocked.stdout


def test_config_show_prints_values_with_sources(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk_size: 64\n")
    res = run("config", "--show", env={"LMCACHE_CORE_CONFIG": str(cfg), "LMCACHE_CORE_SERDE": "lz4"})
    assert res.returncode == 0, res.stderr
    assert f"# from {cfg} (from env var LMCACHE_CORE_CONFIG)\nchunk_size: 64\n" in res.stdout
    assert "# from env var LMCACHE_CORE_SERDE\nserde: lz4\n" in res.stdout
    assert "# from default\nwrite_queue_size: 256\n" in res.stdout


def test_config_show_reports_errors_with_source(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk_size: -1\n")
    res = run("config", "-f", str(cfg))
    assert res.returncode == 2
    assert "chunk_size" in res.stderr and str(cfg) in res.stderr


def test_no_subcommand_prints_help() -> None:
    res = run()
    assert res.returncode == 2 and "plugins" in res.stdout and "config" in res.stdout
