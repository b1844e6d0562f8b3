"""The ``lmcache-core`` command.

Subcommands:

- ``plugins``: every backend, codec, eviction policy and command, with the
  distribution and version it came from, plus plugins that failed to load (exit
  status 1 if any did).
- ``config``: the effective configuration (file, env overrides) with the source of
  each top-level key and of each key of a plugin's section (the vLLM connector's
  ``connector:``, when it is installed), or the validation error.
- ``quarantine``: tiers that running engines took out of service after the
  correctness canary caught them serving wrong KV (``list``), and ``release``.
- ``replay``: a request trace (Mooncake JSONL) through real cache engines, one per
  eviction policy and size (or through the tiers of a config file), next to the
  offline optimum and the never-evicting ceiling; ``--sweep`` draws hit ratio
  against size as a PNG and plans the capacity (:mod:`lmcache_core.replay`).
- ``erase``: delete every chunk of some namespaces (``--namespace ID``, or those
  recorded for ``--model M`` / ``--tenant T``) or all (``--all``) from every tier of a config that it can reach, a count per tier, exit
  status 1 on a partial erase (:mod:`lmcache_core.erase`).
- anything plugins add through the ``register_commands`` hook (for example ``demo``
  from the vLLM connector's distribution, ``serve`` from the peer tier's). The core
  knows them only by what they registered: the parser lists their names and help,
  and a command's own arguments are added (and its module imported) only when that
  command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence, TextIO

import yaml

from .config import ENV_BLOCK_PLUGINS, ConfigError, load_config
from .opening import check_config
from .erase import add_arguments as add_erase_arguments
from .erase import cmd_erase
from .hookspecs import Command
from .plugins import BUILTIN_COMMANDS, PluginManager
from .quarantine import UnsafeDirError, cli_owners, default_dir, open_private_dir, printable, scan_control_files
from .replay import add_arguments as add_replay_arguments
from .replay import cmd_replay

PROG = "lmcache-core"


def _table(rows: Sequence[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def cmd_plugins(args: argparse.Namespace, pm: PluginManager | None = None) -> int:
    """Print installed backends, codecs, eviction policies and commands with their origin."""
    pm = pm or PluginManager()
    out = sys.stdout
    rows = [("KIND", "NAME", "DISTRIBUTION", "VERSION", "DESCRIPTION")]
    for name, b in sorted(pm.backends().items()):
        rows.append(("backend", name, b.origin.distribution, b.origin.version, b.description))
    for name, c in sorted(pm.codecs().items()):
        rows.append(("codec", name, c.origin.distribution, c.origin.version, c.description))
    for name, e in sorted(pm.eviction_policies().items()):
        rows.append(("eviction", name, e.origin.distribution, e.origin.version, e.description))
    for name, cmd in sorted(pm.commands().items()):
        rows.append(("command", name, cmd.origin.distribution, cmd.origin.version, cmd.help))
    _table(rows, out)
    if pm.blocked:
        out.write(f"\nblocked by LMCACHE_CORE_BLOCK_PLUGINS: {', '.join(sorted(pm.blocked))}\n")
    if pm.load_errors:
        out.write("\nplugins that failed to load:\n")
        for msg in pm.load_errors:
            out.write(f"  {msg}\n")
        return 1
    return 0


def cmd_config(args: argparse.Namespace, pm: PluginManager | None = None) -> int:
    """Print the effective configuration as YAML, each key commented with its source
    (the sections of installed plugins included); first, what an engine would refuse
    in it at start (:func:`~lmcache_core.opening.check_config`): exit 2."""
    pm = pm or PluginManager()
    try:
        loaded = load_config(args.file, model=pm.config_model())
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    problems = check_config(loaded, pm)  # what the installed plugins decide: an engine would refuse these
    if problems:
        sys.stderr.write("error: an engine would refuse this configuration:\n" + "".join(f"  {p}\n" for p in problems))
        return 2
    data = loaded.config.model_dump(mode="json")
    for key, value in data.items():
        if key in pm.config_sections():  # its keys come from sources of their own
            sys.stdout.write(f"{key}:\n")
            for sub, inner in value.items():
                text = yaml.safe_dump({sub: inner}, sort_keys=False, default_flow_style=False).rstrip()
                text = "\n".join("  " + line for line in text.splitlines())
                sys.stdout.write(f"  # from {loaded.source_of(f'{key}.{sub}')}\n{text}\n")
            continue
        text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False).rstrip()
        sys.stdout.write(f"# from {loaded.source_of(key)}\n{text}\n")
    return 0


def cmd_quarantine(args: argparse.Namespace, pm: PluginManager | None = None) -> int:
    """List quarantined tiers of running engines, or release them (the engines
    notice within a second that their control file is gone).

    Only a directory that this user (or root) owns and nobody else can write is
    read, without following links; a control file that is a link, FIFO, device or
    over the size cap is skipped with a warning, and every text from a file is
    printed escaped (no raw control characters reach the terminal)."""
    where = args.dir
    if where is None:
        try:
            where = load_config(args.file, model=(pm or PluginManager()).config_model()).config.quarantine_dir
        except ConfigError as err:
            sys.stderr.write(f"error: {err}\n")
            return 2
    d = default_dir() if where is None else Path(where)
    shown_dir = printable(str(d))
    try:
        dir_fd = open_private_dir(d, create=False, owners=cli_owners())
    except FileNotFoundError:
        if args.action == "list":
            sys.stdout.write(f"no quarantined tiers (control files in {shown_dir})\n")
            return 0
        sys.stderr.write(f"error: no quarantine in {shown_dir} (the directory does not exist)\n")
        return 1
    except UnsafeDirError as err:
        sys.stderr.write(f"error: refusing the control directory: {printable(str(err))}\n")
        return 2
    except OSError as err:
        sys.stderr.write(f"error: cannot read the control directory {shown_dir}: {err.strerror}\n")
        return 2
    try:
        return _quarantine_action(args, dir_fd, d)
    finally:
        os.close(dir_fd)


def _quarantine_action(args: argparse.Namespace, dir_fd: int, d: Path) -> int:
    files, skipped = scan_control_files(dir_fd, d)
    for name, why in skipped:
        sys.stderr.write(f"warning: skipped {printable(name)}: {why}\n")
    if args.action == "list":
        if not files:
            sys.stdout.write(f"no quarantined tiers (control files in {printable(str(d))})\n")
            return 0
        rows = [("TIER", "PID", "RUNNING", "SINCE", "WHY")]
        for f in files:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.since))
            rows.append((printable(f.tier), str(f.pid), "yes" if f.alive else "no", since, printable(f.reason)))
        _table(rows, sys.stdout)
        return 0
    if not args.tier and not args.all:
        sys.stderr.write("error: name the tier to release, or --all\n")
        return 2
    chosen = [f for f in files if args.all or f.tier == args.tier]
    if not chosen:
        which = "no quarantined tier" if args.all else f"no quarantine of tier {printable(repr(args.tier))}"
        sys.stderr.write(f"error: {which} in {printable(str(d))}\n")
        return 1
    rc = 0
    for f in chosen:
        try:
            os.unlink(f.path.name, dir_fd=dir_fd)  # unlink never follows a link
        except FileNotFoundError:
            pass
        except OSError as err:
            sys.stderr.write(f"error: cannot release tier {printable(f.tier)} of pid {f.pid}: {err.strerror}\n")
            rc = 1
            continue
        sys.stdout.write(f"released tier {printable(f.tier)} of pid {f.pid}\n")
    return rc


def _add_quarantine_options(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument(
        "--dir",
        default=default,
        help="control-file directory (default: quarantine_dir of the config, else "
        "$XDG_RUNTIME_DIR/lmcache-core-quarantine, else <tmpdir>/lmcache-core-quarantine-<uid>)",
    )
    p.add_argument("--file", "-f", default=default, help="config file (default: $LMCACHE_CORE_CONFIG, else the embedded default)")


def build_parser(pm: PluginManager) -> argparse.ArgumentParser:
    """The top-level parser: built-in commands with their arguments, plugin commands
    by name and help only (their arguments pass through to :func:`main`)."""
    parser = argparse.ArgumentParser(prog=PROG, description="lmcache-core: KV-cache layer for vLLM")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", help="list backends, codecs, eviction policies and commands and where they come from")
    p.set_defaults(func=lambda args: cmd_plugins(args, pm))
    p = sub.add_parser("config", help="show the effective configuration and the source of each key")
    p.add_argument("--file", "-f", help="config file (default: $LMCACHE_CORE_CONFIG, else the embedded default)")
    p.add_argument("--show", action="store_true", help="print the effective config (the default action)")
    p.set_defaults(func=lambda args: cmd_config(args, pm))
    p = sub.add_parser("quarantine", help="list or release tiers the correctness canary quarantined")
    # --dir and --file before the action or after it: on both parsers, the action's
    # copy setting them only when given (so it never overwrites the other's)
    where = argparse.ArgumentParser(add_help=False)
    _add_quarantine_options(p, None)
    _add_quarantine_options(where, argparse.SUPPRESS)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", parents=[where], help="the quarantined tiers (the default action)")
    r = actions.add_parser("release", parents=[where], help="release a quarantined tier, or --all")
    r.add_argument("tier", nargs="?", help="the tier's name (as in backends:)")
    r.add_argument("--all", action="store_true", help="every quarantined tier")
    p.set_defaults(func=lambda args: cmd_quarantine(args, pm), action="list", tier=None, all=False)
    p = sub.add_parser(
        "replay",
        help="replay a request trace through each eviction policy and size, next to the offline optimum",
        description="Replay a Mooncake-format request trace through real cache engines (one per eviction policy and "
        "size, driven as the vLLM connector drives one) and print the hit ratios next to the offline optimum "
        "(Belady, exact for same-sized blocks) and the ceiling of a cache that never evicts.",
    )
    add_replay_arguments(p)
    p.set_defaults(func=lambda args: cmd_replay(args, pm))
    p = sub.add_parser(
        "erase",
        help="delete every chunk of some namespaces (or all) from every tier of a config; a count per tier",
        description="Delete every chunk whose key is in one of the given namespaces (by id, or those the tiers' "
        "namespace records name for a model or tenant; or every chunk) from each tier "
        "of the config that this command can reach, and print a count per tier. Exit status 1 when a tier is down "
        "or cannot list or delete its chunks (a partial erase), 2 on bad arguments or config.",
    )
    add_erase_arguments(p)
    p.set_defaults(func=lambda args: cmd_erase(args, pm))
    for name, info in sorted(pm.commands().items()):
        sub.add_parser(name, help=info.help or f"(from {info.origin.distribution})", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None, *, plugin_manager: PluginManager | None = None) -> int:
    pm = plugin_manager or PluginManager()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = pm.commands()
    parser = build_parser(pm)
    if argv and not argv[0].startswith("-") and argv[0] not in commands and argv[0] not in BUILTIN_COMMANDS:
        # Say why a command may be missing before argparse's "invalid choice".
        if pm.load_errors:
            sys.stderr.write("plugins that failed to load:\n" + "".join(f"  {msg}\n" for msg in pm.load_errors))
        if pm.blocked:
            sys.stderr.write(f"plugins blocked by {ENV_BLOCK_PLUGINS}: {', '.join(sorted(pm.blocked))}\n")
    args, rest = parser.parse_known_args(argv)
    info = commands.get(args.command) if args.command not in BUILTIN_COMMANDS else None
    if info is not None:
        cmd_parser = argparse.ArgumentParser(prog=f"{PROG} {info.name}", description=info.help or None)
        try:
            command = info.configure(cmd_parser)
        except Exception as err:  # noqa: BLE001 - one broken plugin must not break the CLI
            sys.stderr.write(
                f"error: command {info.name!r} from {info.origin.distribution} {info.origin.version} "
                f"failed to load: {type(err).__name__}: {err}\n"
            )
            return 2
        parsed = cmd_parser.parse_args(rest)
        return _run(lambda: int(command(parsed)))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    func: Command | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return _run(lambda: int(func(args)))


def _run(command: Callable[[], int]) -> int:
    """A command's exit status; a reader that went away (``| head``) ends it quietly
    (141, as SIGPIPE would), Ctrl-C with 130 and one line, never a traceback."""
    try:
        rc = command()
        sys.stdout.flush()  # what is still buffered is written here, where a broken pipe is caught
        return rc
    except BrokenPipeError:
        # stdout is gone: point it at /dev/null so the interpreter's last flush is quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
