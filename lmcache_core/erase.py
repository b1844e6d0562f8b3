"""``lmcache-core erase``: delete every chunk of some namespaces (or all) from every
tier of a config that this command can reach, and say per tier what happened.

Each ``backends:`` entry of the config is opened as its own tier, in this process:

- a tier that keeps chunks in the memory pool (the ``local_cpu`` tier, and any
  tier declaring ``pool_bytes``) lives in a running node's memory; no API reaches it
  from here, so it is reported *not reachable from this command* (it empties when
  the node restarts). It does not change the exit status; the report says so.
- a tier that cannot be opened (server down, credentials refused), cannot list its
  chunks (:class:`~lmcache_core.backend.EraseUnsupported`) or fails while erasing
  is reported with the reason, and the exit status is 1: the erase is partial.

Chunk keys carry a namespace id (``v1-<namespace>-<hash>``, the hash of the model,
KV layout, dtype, rank and tenant salt, see :class:`~lmcache_core.keys.KeyNamespace`),
never the model's or tenant's name: ``--namespace`` takes the id (each engine logs
its own at start, ``key namespace <ID>``); ``--model`` and ``--tenant`` are refused
with that explanation until tiers keep a record of namespaces.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from .backend import BackendContext, EraseMatch, EraseUnsupported, StorageBackend
from .config import ConfigError, load_config, read_frame_secret
from .keys import HASH_BYTES
from .memory import MemoryPool
from .plugins import PluginManager
from .serde import FrameSeal, SealedCodec, SealedCodecs, tier_codecs

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
    which.add_argument("--model", metavar="M", help="not supported yet: keys carry a hash, not the model (use --namespace)")
    which.add_argument("--tenant", metavar="T", help="not supported yet: keys carry a hash, not the tenant (use --namespace)")
    p.add_argument("--dry-run", action="store_true", help="count what would be erased; delete nothing")


def parse_match(args: argparse.Namespace) -> EraseMatch:
    """The match the arguments ask for; ValueError with the message for ``error:``."""
    for flag in ("model", "tenant"):
        if getattr(args, flag) is not None:
            raise ValueError(
                f"--{flag}: chunk keys carry only a hash of the namespace (model, layout, dtype, rank, tenant salt), "
                "so a name cannot be matched yet; erase by --namespace ID (each engine logs its id at start: "
                "'key namespace <ID>')"
            )
    if args.all:
        return EraseMatch(None)
    if not args.namespace:
        raise ValueError("say what to erase: --namespace ID (repeatable) or --all")
    ids = set()
    for text in args.namespace:
        try:
            ns = bytes.fromhex(text)
        except ValueError:
            ns = b""
        if len(ns) != HASH_BYTES or text != ns.hex():
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


def erase_tiers(config: str | None, match: EraseMatch, *, dry_run: bool, plugins: PluginManager, err: TextIO) -> list[TierResult]:
    """Open each tier of ``config`` in turn, erase ``match`` from it, close it.
    ConfigError when the config itself is invalid."""
    loaded = load_config(config, model=plugins.config_model())
    cfg = loaded.config
    source = loaded.source_of("backends")
    secret = read_frame_secret(cfg)
    seal = FrameSeal(secret) if secret is not None else None
    codecs = plugins.codec_map()
    base = plugins.get_codec(cfg.serde, source=loaded.source_of("serde"))
    if seal is not None:
        base, codecs = SealedCodec(base, seal), SealedCodecs(codecs, seal)
    pool = MemoryPool(POOL_BYTES)
    results: list[TierResult] = []
    for i, section in enumerate(cfg.backends):
        where = f"backends[{i}] ({section.name})"
        if plugins.pool_bytes(section, key_path=f"backends[{i}]", source=source) > 0:
            results.append(
                TierResult(
                    where, UNREACHABLE, reason="not reachable from this command: its chunks live in a running node's memory"
                )
            )
            continue
        codec = base
        if section.serde is not None:
            codec = plugins.get_codec(section.serde, key_path=f"backends[{i}].serde", source=source)
            codec = SealedCodec(codec, seal) if seal is not None else codec
        ctx = BackendContext(
            key_path=f"backends[{i}]",
            source=source,
            config=cfg,
            pool=pool,
            codec=codec,
            codecs=tier_codecs(codecs, codec),
            plugins=plugins,
        )
        try:
            tier: StorageBackend = plugins.create_backend(section, ctx)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a tier that does not open is reported, the others go on
            results.append(TierResult(where, FAILED, reason=f"could not open the tier: {_one_line(e)}"))
            continue
        try:
            n = tier.erase(match, _Progress(where, err), dry_run=dry_run)
        except EraseUnsupported as e:
            results.append(TierResult(where, FAILED, reason=f"cannot list or erase: {_one_line(e)}"))
        except Exception as e:  # noqa: BLE001 - reported, never a silent success
            results.append(TierResult(where, FAILED, reason=_one_line(e)))
        else:
            results.append(TierResult(where, WOULD if dry_run else DONE, n))
        finally:
            try:
                tier.close()
            except Exception as e:  # noqa: BLE001
                err.write(f"warning: {where}: close failed: {_one_line(e)}\n")
    return results


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def report(results: list[TierResult], match: EraseMatch, out: TextIO) -> int:
    """Print one line per tier and a verdict; the exit status (1 if any tier failed)."""
    what = "every chunk" if match.namespaces is None else f"namespace(s) {', '.join(sorted(n.hex() for n in match.namespaces))}"
    out.write(f"erase {what}:\n")
    rows = [("TIER", "RESULT", "CHUNKS", "DETAIL")]
    for r in results:
        rows.append((r.where, r.outcome, "-" if r.chunks is None else str(r.chunks), r.reason))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
    failed = [r.where for r in results if r.failed]
    unreachable = [r.where for r in results if r.outcome == UNREACHABLE]
    if failed:
        out.write(f"PARTIAL: not erased from {', '.join(failed)}\n")
    if unreachable:
        out.write(f"note: {', '.join(unreachable)} not reachable from this command: restart the nodes to drop those chunks\n")
    return 1 if failed else 0


def cmd_erase(args: argparse.Namespace, pm: PluginManager | None = None) -> int:
    try:
        match = parse_match(args)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    try:
        results = erase_tiers(args.config, match, dry_run=args.dry_run, plugins=pm or PluginManager(), err=sys.stderr)
    except ConfigError as e:
        sys.stderr.write(f"error: {_one_line(e) if not str(e) else str(e).splitlines()[0]}\n")
        return 2
    return report(results, match, sys.stdout)
