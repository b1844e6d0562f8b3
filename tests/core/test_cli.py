"""The ``lmcache-core`` console script, run as a real subprocess: ``plugins`` lists
backends and codecs with the distribution each comes from and reports a broken one;
``config --show`` prints values with their sources, and errors with theirs; no
subcommand prints help; plugin commands arrive through ``register_commands`` (names
checked; ``demo`` and ``serve`` from their own distributions)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lmcache_core import cli
from lmcache_core.hookspecs import Command, RegisterCommand, hookimpl
from lmcache_core.plugins import PluginManager

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


def test_a_blocked_plugin_is_named_where_its_command_or_section_is_missing(tmp_path: Path) -> None:
    """A blocked plugin is installed: a command it adds, or a config section it reads,
    says it is blocked (not only 'invalid choice' or 'not installed')."""
    env = {"LMCACHE_CORE_BLOCK_PLUGINS": "lmcache-connector-vllm"}
    res = run("warm", env=env)
    assert res.returncode == 2 and "plugins blocked by LMCACHE_CORE_BLOCK_PLUGINS: lmcache-connector-vllm" in res.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("connector:\n  layout: block\n")
    res = run("config", "-f", str(cfg), env=env)
    assert res.returncode == 2 and "not installed here or blocked (LMCACHE_CORE_BLOCK_PLUGINS=" in res.stderr, res.stderr
    assert run("config", "-f", str(cfg)).returncode == 0  # control: unblocked, the section is the connector's


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


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("backends: [{name: nope}]", "backends[0].name: unknown backend 'nope'"),
        ("serde: zstd", "serde: unknown codec 'zstd'"),
        ("backends: [{name: local_cpu, serde: zstd}]", "backends[0].serde: unknown codec 'zstd'"),
        ("backends: [{name: local_cpu, bogus: 1}]", "backends[0].bogus: unknown key"),
        ("backends: [{name: local_cpu, retention_share: 0.95}]", "backends[0].retention_share"),
        ("backends: [{name: local_cpu, eviction: bogus}]", "backends[0].eviction: unknown eviction policy 'bogus'"),
        ("backends: [{name: local_cpu, max_size: 100000GiB}]", "the CPU memory pool would be"),
    ],
)
def test_config_says_what_an_engine_would_refuse(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str, fragment: str
) -> None:
    """Keys the installed plugins decide (backends, codecs, policies, the CPU tier's
    section, the pool against the machine): exit 2 with the engine's own words and the
    file, where ``config`` used to print the config and exit 0. Control: the same
    file with the value fixed is shown (exit 0)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text + "\n")
    assert cli.main(["config", "-f", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and str(cfg) in err, err
    cfg.write_text("backends: [{name: local_cpu, max_size: 64MiB, eviction: lru, serde: lz4}]\nserde: raw\n")
    assert cli.main(["config", "-f", str(cfg)]) == 0
    assert "max_size: 64MiB" in capsys.readouterr().out


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert "plugins" in out and "config" in out


class _Commands:
    """A plugin adding three commands through ``register_commands``: one as a
    callable, one by dotted path into a module written for the test, one whose
    dotted path names a module that fails to import."""

    def __init__(self, good: str, bad: str) -> None:
        self.good, self.bad = good, bad

    @hookimpl
    def register_commands(self, register: RegisterCommand) -> None:
        def shout(p: argparse.ArgumentParser) -> Command:
            p.add_argument("word")
            return lambda args: print(args.word.upper()) or 0

        register("shout", shout, help="say it loud")
        register("hello", f"{self.good}:setup", help="greet someone")
        register("broken", f"{self.bad}:setup", help="cannot load")


def test_plugin_commands_arrive_through_the_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """How ``lmcache-core demo`` and ``serve`` arrive: ``register_commands``. A command
    registered by dotted path is imported only when it runs; a command whose module
    fails to import says why and exits 2 while the others still work."""
    tag = uuid.uuid4().hex[:8]
    good, bad = f"cmd_good_{tag}", f"cmd_bad_{tag}"
    (tmp_path / f"{good}.py").write_text(
        "def setup(p):\n    p.add_argument('--name', default='world')\n    return lambda args: print('hello', args.name) or 0\n"
    )
    (tmp_path / f"{bad}.py").write_text("import a_module_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager(load_entry_points=False)
    pm.register(_Commands(good, bad), name="test-commands")
    assert cli.main([], plugin_manager=pm) == 2
    listing = capsys.readouterr().out
    assert "say it loud" in listing and "greet someone" in listing
    assert good not in sys.modules  # listing commands imports none of them
    assert cli.main(["shout", "hey"], plugin_manager=pm) == 0
    assert capsys.readouterr().out == "HEY\n"
    assert cli.main(["hello", "--name", "vllm"], plugin_manager=pm) == 0
    assert capsys.readouterr().out == "hello vllm\n"
    assert cli.main(["broken"], plugin_manager=pm) == 2
    assert "a_module_that_is_not_installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the command's own parser rejects what it does not know
        cli.main(["hello", "--nme", "x"], plugin_manager=pm)
    with pytest.raises(SystemExit):
        cli.main(["absent"], plugin_manager=pm)


@pytest.mark.parametrize("name", ["plugins", "Bad_Name", ""])
def test_plugin_command_names_are_checked(name: str) -> None:
    class Taker:
        @hookimpl
        def register_commands(self, register: RegisterCommand) -> None:
            register(name, lambda p: lambda args: 0)

    pm = PluginManager(load_entry_points=False)
    pm.register(Taker(), name="taker")
    assert pm.commands() == {}
    assert len(pm.load_errors) == 1 and "'taker'" in pm.load_errors[0] and "command name" in pm.load_errors[0]


def test_first_party_commands_come_from_their_distributions() -> None:
    """``demo``, ``warm``, ``lookup``, ``serve`` and ``admin`` are registered by the
    connector's and the peer tier's distributions (entry points), not by the core."""
    res = run("plugins")
    assert res.returncode == 0, res.stderr
    commands = {cols[1]: cols[2] for cols in map(str.split, res.stdout.splitlines()) if cols and cols[0] == "command"}
    assert commands == {
        "demo": "lmcache-connector-vllm",
        "warm": "lmcache-connector-vllm",
        "lookup": "lmcache-connector-vllm",
        "serve": "lmcache-backend-peer",
        "admin": "lmcache-backend-peer",
    }
    demo_help = run("demo", "--help")
    assert demo_help.returncode == 0 and "--quick" in demo_help.stdout
