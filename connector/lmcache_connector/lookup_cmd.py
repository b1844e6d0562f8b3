"""``lmcache-core lookup``: which tiers of a config hold how many chunks of some prompts.

Each prompt is tokenized as ``lmcache-core warm`` and the server do it (the model's
tokenizer; ``--prefix``, ``--chat-template``), its chunks hashed as the connector
hashes a request's (``--cache-salt`` and ``--lora`` seed the chain as vLLM's request
fields do), and the keys asked of every tier of the config that this command can
open, for every key namespace the tiers' records name for ``--model`` (each tensor-
parallel rank, layout and dtype the model was served with) or for ``--namespace``.
Read-only: a lookup moves nothing and loads nothing. The CPU tier lives in running
engines' memory and is not asked.

Prints, per prompt, its tokens, its whole chunks and, per tier and namespace, how
many of them from the first are held; then a total. Exit 0; 1 when a tier could not
be asked (down); 2 on bad arguments, corpus or config.

``--keys``: print the prompts' chunk keys instead, one a line (every namespace, head
first), asking no tier: what a cache node's admin API takes, e.g. to keep a prompt's
chunks on a node for an hour, ``lmcache-core admin ... retain $(lmcache-core lookup
... --keys) --seconds 3600``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from .warm import CorpusError, Summary, prompt_ids, read_corpus


def setup_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("--config", required=True, type=Path, help="the lmcache.yaml the server uses")
    p.add_argument(
        "--model", required=True, help="the model as the server was given it (its tokenizer, and the name records use)"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", action="append", help="a prompt (repeatable)")
    src.add_argument("--jsonl", type=Path, help="one JSON object a line, with 'prompt' or 'text'")
    src.add_argument("--dir", type=Path, help="a directory of *.txt documents")
    p.add_argument("--prefix", default="", help="text put before every prompt (as warm's --prefix)")
    p.add_argument("--chat-template", action="store_true", help="wrap prefix + prompt as a user message")
    p.add_argument("--namespace", action="append", metavar="ID", help="ask these namespace ids instead of the model's records")
    p.add_argument("--cache-salt", default=None, help="the requests' cache_salt, if they carry one")
    p.add_argument("--lora", default=None, help="the requests' LoRA adapter name, if any")
    p.add_argument("--limit", type=int, default=1000, help="prompts looked up at most (default 1000)")
    p.add_argument("--keys", action="store_true", help="print the chunk keys (one a line) instead of asking the tiers")
    return run


def _namespaces(args: argparse.Namespace, tiers: list[Any]) -> dict[bytes, str]:
    """Namespace id -> a label (model, rank): ``--namespace``, or the records of ``--model``."""
    from lmcache_core.namespaces import namespace_of, parse_records

    if args.namespace:
        ids = {namespace_of(t): t for t in args.namespace}
        if None in ids:
            raise CorpusError(f"--namespace: not a namespace id (32 lowercase hex digits): {ids[None]!r}")
        return {ns: ns.hex()[:8] for ns in ids if ns is not None}
    found: dict[bytes, str] = {}
    models: set[str] = set()
    for o in tiers:
        try:
            records, _ = parse_records(o.tier.namespace_records())
        except Exception:  # noqa: BLE001 - a tier without records, or down: the others may have them
            continue
        for r in records:
            models.add(r.model)
            if r.model == args.model:
                found[r.namespace] = f"rank {r.rank}/{r.world_size}" + (f" {r.tenant}" if r.tenant else "")
    if not found:
        known = ", ".join(sorted(repr(m) for m in models)) or "none"
        raise CorpusError(f"no tier records a namespace of model {args.model!r} (recorded: {known}); give --namespace ID")
    return found


def _prompts(args: argparse.Namespace, err: TextIO) -> list[list[int]]:
    from vllm.tokenizers import get_tokenizer

    tok: Any = get_tokenizer(args.model)
    summary = Summary()
    texts = iter(args.text) if args.text else read_corpus(args, summary, err)
    out: list[list[int]] = []
    for text in texts:
        if len(out) >= args.limit:
            break
        out.append(prompt_ids(tok, text, args, sys.maxsize, summary))
    return out


def lookup(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from lmcache_core.config import ConfigError
    from lmcache_core.erase import open_command_tiers
    from lmcache_core.keys import chain_seed
    from lmcache_core.plugins import PluginManager

    if args.limit < 1:
        raise CorpusError(f"--limit must be at least 1, got {args.limit}")
    try:
        opened, cfg = open_command_tiers(str(args.config), PluginManager())
    except ConfigError as e:
        raise CorpusError(e.one_line()) from None
    try:
        spaces = _namespaces(args, [o for o in opened if o.tier is not None])
        prompts = _prompts(args, err)
        if not prompts:
            raise CorpusError("no prompt to look up")
        tags = {k: v for k, v in (("vllm:cache_salt", args.cache_salt), ("vllm:lora", args.lora)) if v}
        if args.keys:
            return _print_keys(prompts, cfg.chunk_size, chain_seed(tags), spaces, out)
        return _report(prompts, cfg.chunk_size, chain_seed(tags), spaces, opened, out)
    finally:
        for o in opened:
            if o.tier is not None:
                o.tier.close()


def _print_keys(prompts: list[list[int]], cs: int, seed: bytes, spaces: dict[bytes, str], out: TextIO) -> int:
    """Every whole chunk's key of every prompt, per namespace, head first, one a line."""
    from lmcache_core.keys import ChunkKey, chunk_hashes

    for p in prompts:
        hashes = chunk_hashes(p, cs, seed=seed)
        for ns in spaces:
            out.writelines(f"{ChunkKey(ns, h)}\n" for h in hashes)
    return 0


def _report(prompts: list[list[int]], cs: int, seed: bytes, spaces: dict[bytes, str], opened: list[Any], out: TextIO) -> int:
    """One line per prompt, the totals, what was not asked; the exit status."""
    from lmcache_core.keys import ChunkKey, chunk_hashes

    failed: list[str] = []
    totals: dict[tuple[str, bytes], int] = {}
    whole = 0
    for i, p in enumerate(prompts):
        hashes = chunk_hashes(p, cs, seed=seed)
        whole += len(hashes)
        cells = []
        for o in (o for o in opened if o.tier is not None):
            for ns, label in spaces.items():
                try:
                    held = int(o.tier.contains([ChunkKey(ns, h) for h in hashes]))
                except Exception as e:  # noqa: BLE001 - reported; the other tiers are still asked
                    failed.append(f"{o.where}: {type(e).__name__}: {e}")
                    held = 0
                totals[(o.where, ns)] = totals.get((o.where, ns), 0) + held
                cells.append(f"{o.where} [{label}] {held}/{len(hashes)}")
        out.write(f"prompt {i + 1}: {len(p)} tokens, {len(hashes)} whole chunks; " + "; ".join(cells) + "\n")
    out.write(f"total: {len(prompts)} prompts, {whole} whole chunks of {cs} tokens\n")
    for (where, ns), held in totals.items():
        out.write(f"  {where} [{spaces[ns]}]: {held} held ({held / max(whole, 1):.1%})\n")
    for o in opened:
        if o.tier is None and o.result is not None:
            out.write(f"  {o.where}: not asked ({o.result.reason})\n")
    for f in dict.fromkeys(failed):
        out.write(f"FAILED: {f}\n")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    try:
        return lookup(args, sys.stdout, sys.stderr)
    except CorpusError as e:
        sys.stderr.write(f"lookup: {e}\n")
        return 2
