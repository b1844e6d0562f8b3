"""``lmcache-core erase``: delete every chunk of some namespaces (or all) from every
tier of a config that this command can reach, and say per tier what happened.

Each ``backends:`` entry of the config is opened as its own tier, in this process:

- a tier that keeps chunks in the memory pool (the ``local_cpu`` tier, and any
  tier declaring ``pool_bytes``) lives in each running engine's memory: the engines
  of this user that use the config's control directory (``quarantine_dir``) are
  asked to erase it (:mod:`lmcache_core.control`) and their counts are summed; an
  engine that does not answer within ``--engines-wait-s`` makes the erase partial.
  Engines of other users, or with another control directory, are not reached.
- a tier that cannot be opened (server down, credentials refused), cannot list its
  chunks (:class:`~lmcache_core.backend.EraseUnsupported`) or fails while erasing
  is reported with the reason, and the exit status is 1: the erase is partial.

Chunk keys carry a namespace id (``v1-<namespace>-<hash>``, the hash of the model,
KV layout, dtype, rank and tenant salt, see :class:`~lmcache_core.keys.KeyNamespace`),
never the model's or tenant's name: ``--namespace`` takes the id (each engine logs
its own at start, ``key namespace <ID>``). ``--model M`` and ``--tenant T`` read the
namespace records every engine leaves in the tiers it writes
(:mod:`lmcache_core.namespaces`), take the ids recorded for M or T in any tier, and
erase those ids from every tier; a tier whose records cannot be read (a server
down) makes the erase partial (namespaces recorded only there would be missed). A
tier that keeps no records at all (chunks in a cache node's memory, Mooncake Store:
:class:`~lmcache_core.backend.EraseUnsupported` from ``namespace_records``) is erased
of the ids the other tiers record, with a note; if no tier of the config keeps
records, nothing can be resolved and those tiers fail (use ``--namespace``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from .backend import EraseMatch, EraseUnsupported, StorageBackend
from .config import ConfigError, CoreConfig, check_seconds, load_config, read_frame_secret
from .control import MAX_WAIT_S, WAIT_S, ask_engines
from .keys import HASH_BYTES
from .memory import MemoryPool
from .namespaces import NamespaceRecord, namespace_of, parse_records
from .plugins import PluginManager
from .opening import Codecs, tier_context
from .serde import FrameSeal

#: the pool handed to tiers opened here (no chunk is read or written through it)
POOL_BYTES = 1 << 20
#: seconds between two progress lines on stderr
PROGRESS_EVERY_S = 1.0

DONE = "erased"
WOULD = "would-erase"
UNREACHABLE = "unreachable"
FAILED = "FAILED"


@dataclass
class TierResult:
    where: str  # backends[i] (name)
    outcome: str  # DONE, WOULD, UNREACHABLE or FAILED
    chunks: int | None = None
    reason: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome == FAILED


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-f", help="config file (default: $LMCACHE_CORE_CONFIG, else the embedded default)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--namespace",
        action="append",
        metavar="ID",
        help="a namespace id, 32 hex digits (the middle part of every key: v1-<namespace>-<hash>); repeatable",
    )
    which.add_argument("--all", action="store_true", help="every chunk key of every tier")
    which.add_argument("--model", metavar="M", help="every namespace recorded for model M (the name vLLM serves it by)")
    which.add_argument("--tenant", metavar="T", help="every namespace recorded for tenant label T (the config's tenant)")
    p.add_argument("--dry-run", action="store_true", help="count what would be erased; delete nothing")
    p.add_argument(
        "--engines-wait-s",
        type=_wait_seconds,
        default=WAIT_S,
        help=f"how long running engines get to erase their CPU tier, 0.1 to {MAX_WAIT_S:g} (default {WAIT_S:g})",
    )


def _wait_seconds(text: str) -> float:
    """``--engines-wait-s``: a finite number of seconds within bounds (a request lives
    that long in the control directory; NaN or infinity would never expire)."""
    try:
        return check_seconds(float(text), min_s=0.1, max_s=MAX_WAIT_S)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


@dataclass(frozen=True)
class ByName:
    """``--model M`` or ``--tenant T``: the namespaces whose records name it."""

    field: str  # "model" or "tenant"
    value: str

    def takes(self, record: NamespaceRecord) -> bool:
        return bool(getattr(record, self.field) == self.value)


def parse_match(args: argparse.Namespace) -> EraseMatch | ByName:
    """The match the arguments ask for; ValueError with the message for ``error:``."""
    for flag in ("model", "tenant"):
        value = getattr(args, flag)
        if value is not None:
            if not value:
                raise ValueError(f"--{flag}: empty")
            return ByName(flag, value)
    if args.all:
        return EraseMatch(None)
    if not args.namespace:
        raise ValueError("say what to erase: --namespace ID (repeatable), --model M, --tenant T or --all")
    ids = set()
    for text in args.namespace:
        ns = namespace_of(text)
        if ns is None:
            raise ValueError(f"--namespace {text!r}: not a namespace id ({2 * HASH_BYTES} lowercase hex digits)")
        ids.add(ns)
    return EraseMatch(frozenset(ids))


class _Progress:
    """Progress lines on stderr, at most one per :data:`PROGRESS_EVERY_S`."""

    def __init__(self, where: str, out: TextIO) -> None:
        self.where = where
        self.out = out
        self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.out.write(f"erase: {self.where}: {n} chunks so far\n")
            self.out.flush()


@dataclass
class Opened:
    """One ``backends:`` entry as this command found it: an open tier, or a result."""

    where: str
    tier: StorageBackend | None = None
    result: TierResult | None = None


@dataclass
class Erased:
    """What :func:`erase_tiers` did: a result per tier and the match it used (for
    ``--model``/``--tenant``: the ids recorded for that name in any tier)."""

    results: list[TierResult]
    match: EraseMatch
    by: ByName | None = None
    #: for --model/--tenant: the names recorded in the tiers (what was there to match)
    recorded: set[str] | None = None


def erase_tiers(
    config: str | None,
    which: EraseMatch | ByName,
    *,
    dry_run: bool,
    plugins: PluginManager,
    err: TextIO,
    engines_wait_s: float = WAIT_S,
) -> Erased:
    """Open each tier of ``config``, erase the match from each (the tiers in running
    engines' memory through the control directory), close them. For a
    :class:`ByName`, the namespace records of every open tier are read first.
    ConfigError when the config itself is invalid."""
    opened, cfg = open_command_tiers(config, plugins)
    try:
        by = which if isinstance(which, ByName) else None
        unreadable: dict[str, str] = {}
        recorded: set[str] | None = None
        match = which if isinstance(which, EraseMatch) else EraseMatch(frozenset())
        notes: dict[str, str] = {}
        if by is not None:
            match, recorded, unreadable, notes = _resolve(opened, by)
        done: dict[str, TierResult] = {}
        # The slower tiers first, the engines' memory tiers last: erased the other way
        # round, a live engine's lookup could read a chunk back from a slower tier
        # into memory between the two, and keep serving it.
        for o in opened:
            if o.result is not None:
                continue
            assert o.tier is not None
            r = (
                _erase_one(o.where, o.tier, match, dry_run, err)
                if match.namespaces != frozenset()
                else TierResult(o.where, WOULD if dry_run else DONE, 0)
            )
            if o.where in unreadable and not r.failed:
                erased = f" ({r.chunks} chunks of the ids found elsewhere erased)" if r.chunks else ""
                r = TierResult(o.where, FAILED, r.chunks, f"cannot read its namespace records: {unreadable[o.where]}{erased}")
            elif o.where in notes and not r.failed:
                r = TierResult(r.where, r.outcome, r.chunks, notes[o.where])
            done[o.where] = r
        in_memory = _in_engines(opened, cfg.quarantine_dir, match, dry_run, engines_wait_s)
        results = [done[o.where] if o.result is None else in_memory.get(o.where, o.result) for o in opened]
        return Erased(results, match, by, recorded)
    finally:
        for o in opened:
            if o.tier is not None:
                try:
                    o.tier.close()
                except Exception as e:  # noqa: BLE001
                    err.write(f"warning: {o.where}: close failed: {_one_line(e)}\n")


def _resolve(opened: list[Opened], by: ByName) -> tuple[EraseMatch, set[str], dict[str, str], dict[str, str]]:
    """The ids recorded for ``by`` in any open tier, every name recorded for its field,
    the tiers whose records could not be read (with why), and notes for tiers that
    keep none (see the module doc)."""
    ids: set[bytes] = set()
    names: set[str] = set()
    unreadable: dict[str, str] = {}
    keeps_none: dict[str, str] = {}
    for o in opened:
        if o.tier is None:
            continue
        try:
            records, _skipped = parse_records(o.tier.namespace_records())
        except EraseUnsupported as e:
            keeps_none[o.where] = _one_line(e)
            continue
        except Exception as e:  # noqa: BLE001 - a server away: reported per tier
            unreadable[o.where] = _one_line(e)
            continue
        for r in records:
            value = getattr(r, by.field)
            if value is not None:
                names.add(value)
            if by.takes(r):
                ids.add(r.namespace)
    notes = {}
    readable = [o for o in opened if o.tier is not None and o.where not in unreadable and o.where not in keeps_none]
    for where, why in keeps_none.items():
        if readable:
            notes[where] = "keeps no namespace records: erased the ids the other tiers record"
        else:
            unreadable[where] = f"no tier of this config keeps namespace records ({why}); erase by --namespace ID"
    return EraseMatch(frozenset(ids)), names, unreadable, notes


def _in_engines(
    opened: list[Opened], control_dir: str | None, match: EraseMatch, dry_run: bool, wait_s: float
) -> dict[str, TierResult]:
    """The results of the tiers in running engines' memory, after asking the engines
    (the first such tier carries the count of all)."""
    pooled = [o.where for o in opened if o.result is not None and o.result.outcome == UNREACHABLE]
    if not pooled:
        return {}
    done = WOULD if dry_run else DONE
    if match.namespaces == frozenset():
        return {w: TierResult(w, done, 0) for w in pooled}
    a = ask_engines(control_dir, match, dry_run=dry_run, wait_s=wait_s)
    if a.error is not None:
        return {w: TierResult(w, UNREACHABLE, reason=f"running engines not reached: {a.error}") for w in pooled}
    n, engines = sum(a.chunks.values()), len(a.chunks) + len(a.silent) + len(a.failed)
    if a.silent or a.failed:
        why = [f"engine {e} did not answer within {wait_s:g} s" for e in a.silent]
        why += [f"engine {e}: {m}" for e, m in a.failed.items()]
        first = TierResult(pooled[0], FAILED, n, "; ".join(why))
    else:
        what = f"in {engines} running engine(s)" if engines else "no running engine uses this control directory"
        first = TierResult(pooled[0], done, n, what)
    rest = {w: TierResult(w, first.outcome, None, f"counted under {pooled[0]}") for w in pooled[1:]}
    return {pooled[0]: first, **rest}


def open_command_tiers(config: str | None, plugins: PluginManager) -> tuple[list[Opened], CoreConfig]:
    """Every ``backends:`` entry opened for a command (serving nothing), or its result
    (in engines' memory; failed to open); and the config itself. ConfigError for an
    invalid config. Also what ``lmcache-core lookup`` opens."""
    loaded = load_config(config, model=plugins.config_model())
    secret = read_frame_secret(loaded.config)
    codecs = Codecs(loaded, plugins, FrameSeal(secret) if secret is not None else None)
    source = loaded.source_of("backends")
    pool = MemoryPool(POOL_BYTES)
    opened: list[Opened] = []
    try:
        for i, section in enumerate(loaded.config.backends):
            where = f"backends[{i}] ({section.name})"
            if plugins.pool_bytes(section, key_path=f"backends[{i}]", source=source) > 0:
                reason = "its chunks live in running engines' memory"
                opened.append(Opened(where, result=TierResult(where, UNREACHABLE, reason=reason)))
                continue
            ctx = tier_context(codecs, pool, i, serving=False)
            try:
                opened.append(Opened(where, tier=plugins.create_backend(section, ctx)))
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - a tier that does not open is reported, the others go on
                opened.append(Opened(where, result=TierResult(where, FAILED, reason=f"could not open the tier: {_one_line(e)}")))
    except BaseException:
        for o in opened:
            if o.tier is not None:
                o.tier.close()
        raise
    return opened, loaded.config


def _erase_one(where: str, tier: StorageBackend, match: EraseMatch, dry_run: bool, err: TextIO) -> TierResult:
    try:
        n = tier.erase(match, _Progress(where, err), dry_run=dry_run)
    except EraseUnsupported as e:
        return TierResult(where, FAILED, reason=f"cannot list or erase: {_one_line(e)}")
    except Exception as e:  # noqa: BLE001 - reported, never a silent success
        return TierResult(where, FAILED, reason=_one_line(e))
    return TierResult(where, WOULD if dry_run else DONE, n)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def report(done: Erased, out: TextIO) -> int:
    """Print one line per tier and a verdict; the exit status (1 if any tier failed)."""
    match, results = done.match, done.results
    ids = "" if match.namespaces is None else ", ".join(sorted(n.hex() for n in match.namespaces))
    if done.by is not None:
        what = f"{done.by.field} {done.by.value!r}: namespace(s) {ids or '(none recorded)'}"
    else:
        what = "every chunk" if match.namespaces is None else f"namespace(s) {ids}"
    out.write(f"erase {what}:\n")
    rows = [("TIER", "RESULT", "CHUNKS", "DETAIL")]
    for r in results:
        rows.append((r.where, r.outcome, "-" if r.chunks is None else str(r.chunks), r.reason))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
    failed = [r.where for r in results if r.failed]
    unreachable = [r.where for r in results if r.outcome == UNREACHABLE]
    if done.by is not None and not ids:
        known = ", ".join(repr(n) for n in sorted(done.recorded or ())) or "none"
        out.write(f"note: no tier records a namespace of {done.by.field} {done.by.value!r} (recorded: {known})\n")
    if failed:
        out.write(f"PARTIAL: not erased from {', '.join(failed)}\n")
    if unreachable:
        out.write(f"note: {', '.join(unreachable)} not reachable from this command: restart the engines to drop those chunks\n")
    return 1 if failed else 0


def cmd_erase(args: argparse.Namespace, pm: PluginManager | None = None) -> int:
    try:
        which = parse_match(args)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    try:
        done = erase_tiers(
            args.config,
            which,
            dry_run=args.dry_run,
            plugins=pm or PluginManager(),
            err=sys.stderr,
            engines_wait_s=args.engines_wait_s,
        )
    except ConfigError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        return 2
    return report(done, sys.stdout)
