"""The ``lmcache-core`` command.

Subcommands:

- ``plugins``: every backend and codec, with the distribution and version it came
  from, plus plugins that failed to load (exit status 1 if any did).
- ``config``: the effective configuration (file, env overrides) with the source of
  each top-level key, or the validation error.
- ``demo``: added by ``lmcache_connector.demo`` when that distribution is
  installed; ``serve`` (a standalone peer cache node) by ``lmcache_backend_peer.cli``. Its contract: a module-level ``add_parser(subparsers)`` that adds a
  sub-parser and sets ``func`` (``args -> int`` exit status) with ``set_defaults``.
  The module is imported on every invocation, so it must import vLLM lazily.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Callable, Sequence, TextIO

import yaml

from .config import ConfigError, load_config
from .plugins import PluginManager

Command = Callable[[argparse.Namespace], int]

# Distributions that add subcommands: module name -> subcommand it provides.
EXTENSIONS = {"lmcache_connector.demo": "demo", "lmcache_backend_peer.cli": "serve"}


def _table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def cmd_plugins(args: argparse.Namespace) -> int:
    """Print installed backends, codecs and eviction policies with their origin."""
    pm = PluginManager()
    out = sys.stdout
    rows = [("KIND", "NAME", "DISTRIBUTION", "VERSION", "DESCRIPTION")]
    for name, b in sorted(pm.backends().items()):
        rows.append(("backend", name, b.origin.distribution, b.origin.version, b.description))
    for name, c in sorted(pm.codecs().items()):
        rows.append(("codec", name, c.origin.distribution, c.origin.version, c.description))
    for name, e in sorted(pm.eviction_policies().items()):
        rows.append(("eviction", name, e.origin.distribution, e.origin.version, e.description))
    _table(rows, out)
    if pm.blocked:
        out.write(f"\nblocked by LMCACHE_CORE_BLOCK_PLUGINS: {', '.join(sorted(pm.blocked))}\n")
    if pm.load_errors:
        out.write("\nplugins that failed to load:\n")
        for msg in pm.load_errors:
            out.write(f"  {msg}\n")
        return 1
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective configuration as YAML, each key commented with its source."""
    try:
        loaded = load_config(args.file)
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    data = loaded.config.model_dump(mode="json")
    for key, value in data.items():
        text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False).rstrip()
        sys.stdout.write(f"# from {loaded.source_of(key)}\n{text}\n")
    return 0


def _add_extensions(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Let installed distributions add subcommands; a broken one becomes a
    subcommand that reports why it is unavailable instead of breaking the CLI."""
    for module, command in EXTENSIONS.items():
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ImportError:  # the distribution is not installed
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except Exception as err:  # noqa: BLE001 - reported when the command is used
            reason = f"{module} failed to load: {type(err).__name__}: {err}"
            p = sub.add_parser(command, help=f"(unavailable) {reason}")
            p.set_defaults(func=_unavailable(reason))


def _unavailable(reason: str) -> Command:
    def run(args: argparse.Namespace) -> int:
        sys.stderr.write(f"error: {reason}\n")
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-core", description="lmcache-core: KV-cache layer for vLLM")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", help="list backends, codecs and eviction policies and where they come from")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("config", help="show the effective configuration and the source of each key")
    p.add_argument("--file", "-f", help="config file (default: $LMCACHE_CORE_CONFIG, else the embedded default)")
    p.add_argument("--show", action="store_true", help="print the effective config (the default action)")
    p.set_defaults(func=cmd_config)
    _add_extensions(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
