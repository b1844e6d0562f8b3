"""Acceptance 8: the ``lmcache-core`` console script, run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lmcache_core import cli

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


# The config subcommand and help run in-process (same code path as the script,
# without paying for another interpreter start).


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("LMCACHE_CORE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_config_show_prints_values_with_sources(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk_size: 64\n")
    clean_env.setenv("LMCACHE_CORE_CONFIG", str(cfg))
    clean_env.setenv("LMCACHE_CORE_SERDE", "lz4")
    assert cli.main(["config", "--show"]) == 0
    out = capsys.readouterr().out
    assert f"# from {cfg} (from env var LMCACHE_CORE_CONFIG)\nchunk_size: 64\n" in out
    assert "# from env var LMCACHE_CORE_SERDE\nserde: lz4\n" in out
    assert "# from default\nwrite_queue_size: 256\n" in out


def test_config_show_reports_errors_with_source(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk_size: -1\n")
    assert cli.main(["config", "-f", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "chunk_size" in err and str(cfg) in err


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert "plugins" in out and "config" in out


def test_extension_modules_add_subcommands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """How ``lmcache-core demo`` arrives from lmcache_connector.demo: a module with
    ``add_parser(subparsers)``. A module that fails to import becomes a subcommand
    that says why; a module that is not installed adds nothing."""
    tag = uuid.uuid4().hex[:8]
    good, bad = f"ext_good_{tag}", f"ext_bad_{tag}"
    (tmp_path / f"{good}.py").write_text(
        "def add_parser(sub):\n"
        "    p = sub.add_parser('hello')\n"
        "    p.add_argument('--name', default='world')\n"
        "    p.set_defaults(func=lambda args: print('hello', args.name) or 0)\n"
    )
    (tmp_path / f"{bad}.py").write_text("import a_module_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "EXTENSIONS", {good: "hello", bad: "broken", f"not_installed_{tag}.demo": "absent"})
    assert cli.main(["hello", "--name", "vllm"]) == 0
    assert capsys.readouterr().out == "hello vllm\n"
    assert cli.main(["broken"]) == 2
    assert "a_module_that_is_not_installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["absent"])
