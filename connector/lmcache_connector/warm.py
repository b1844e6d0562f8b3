"""``lmcache-core warm``: fill the cache from a corpus before traffic arrives.

Each document is prefilled once through vLLM offline (one output token, discarded)
with the connector configured by your ``lmcache.yaml``, so its KV lands in the
config's tiers; a server started later with the same model and config hits it at
once. Only tiers that outlive this command are worth warming (disk, S3, Redis,
Mooncake, a cache node): a config whose tiers all live in this process's memory is
refused.

The corpus: ``--jsonl FILE`` (one JSON object a line with ``prompt`` or ``text``;
blank lines skipped; a bad line is reported with its number and skipped), or
``--dir DIR`` (every ``*.txt`` file, sorted by name). ``--prefix`` is put before every
document, and ``--chat-template`` wraps ``prefix + document`` as one user message
with the tokenizer's chat template, so the prompt starts the way the server's chat
requests about the document will. Documents longer than the model's context are
cut to fit (counted).

Resumable: before a batch is prefilled, each document's whole chunks are looked up
in the tiers (hashed as the connector hashes a request without a cache salt); a
document whose every whole chunk is stored is skipped, not prefilled, and so is one
shorter than a chunk (nothing of it would be stored). A document stored in part is
prefilled, vLLM loading the stored part. The summary counts the documents skipped
and the tokens computed, so a rerun shows it did no prefill work. Bounded: the corpus is read in batches of
``--batch`` documents. Ctrl-C stops after flushing what was stored; chunk files and
objects are written whole or not at all, so nothing is left corrupt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

MAX_LINE_BYTES = 64 << 20
MAX_FILE_BYTES = 64 << 20


class CorpusError(ValueError):
    pass


def setup_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``lmcache-core warm`` (registered in :mod:`.plugin`)."""
    p.add_argument("--model", required=True, help="the model the server will serve (a path or a name vLLM can load)")
    p.add_argument("--config", required=True, type=Path, help="the lmcache.yaml the server will use")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--jsonl", type=Path, help="one JSON object a line, with 'prompt' or 'text'")
    src.add_argument("--dir", type=Path, help="a directory of *.txt documents")
    p.add_argument("--prefix", default="", help="text put before every document")
    p.add_argument("--chat-template", action="store_true", help="wrap prefix + document as a user message (chat template)")
    p.add_argument("--batch", type=int, default=16, help="documents prefilled together (default 16)")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's context length (default: the model's)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20, help="vLLM's KV cache (default 512 MiB)")
    p.add_argument("--limit", type=int, default=None, help="warm at most this many documents")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    return run


@dataclass
class Summary:
    documents: int = 0
    bad_lines: int = 0
    truncated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # loaded from the cache instead of computed
    fully_cached: int = 0  # documents of which only the last token was computed
    skipped: int = 0  # documents whose every whole chunk was stored already: not prefilled
    skipped_tokens: int = 0
    too_short: int = 0  # documents shorter than one chunk: nothing to store, not prefilled
    seconds: float = 0.0
    interrupted: bool = False
    tiers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens - self.skipped_tokens


def read_corpus(args: argparse.Namespace, summary: Summary, err: TextIO) -> Iterator[str]:
    """The documents, one at a time (bounded memory)."""
    if args.dir is not None:
        if not args.dir.is_dir():
            raise CorpusError(f"--dir {args.dir}: not a directory")
        files = sorted(p for p in args.dir.glob("*.txt") if p.is_file())
        if not files:
            raise CorpusError(f"--dir {args.dir}: no *.txt files")
        for path in files:
            if path.stat().st_size > MAX_FILE_BYTES:
                summary.bad_lines += 1
                err.write(f"warm: {path}: larger than {MAX_FILE_BYTES >> 20} MiB, skipped\n")
                continue
            yield path.read_text(errors="replace")
        return
    try:
        f = open(args.jsonl, "rb")
    except OSError as e:
        raise CorpusError(f"--jsonl {args.jsonl}: cannot open: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if not raw.strip():
                continue
            why = None
            text = None
            if len(raw) > MAX_LINE_BYTES:
                why = f"longer than {MAX_LINE_BYTES >> 20} MiB"
                while raw and not raw.endswith(b"\n"):  # the rest of the line
                    raw = f.readline(MAX_LINE_BYTES + 1)
            else:
                try:
                    obj = json.loads(raw)
                except (ValueError, UnicodeDecodeError) as e:
                    why = f"not JSON ({e})"
                else:
                    text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
                    if not isinstance(text, str) or not text:
                        why = "no non-empty string 'prompt' or 'text'"
            if why is not None:
                summary.bad_lines += 1
                err.write(f"warm: {args.jsonl}:{lineno}: {why}; skipped\n")
                continue
            assert text is not None
            yield text


def _tiers_outlive_us(config: Path) -> None:
    """A config whose tiers all live in this process's memory is refused: warming it
    would store nothing that outlives the command."""
    from lmcache_core.config import ConfigError, load_config

    from .settings import ConnectorConfig

    try:
        names = [sec.name for sec in load_config(config, model=ConnectorConfig).config.backends]
    except ConfigError as err:
        raise CorpusError(err.one_line()) from None
    if all(n == "local_cpu" for n in names):
        raise CorpusError(
            f"{config}: every tier ({', '.join(names)}) lives in this process's memory: warming it stores nothing "
            "that outlives this command; add a persistent or shared tier (disk, s3, redis, mooncake, peer)"
        )


class Progress:
    def __init__(self, out: TextIO, enabled: bool) -> None:
        self.out, self.enabled = out, enabled and out.isatty()
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, s: Summary, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not final and now - self.last < 1.0):
            return
        self.last = now
        rate = s.computed_tokens / max(now - self.t0, 1e-9)
        self.out.write(
            f"\rwarm: {s.documents} documents ({s.skipped} already stored), {s.prompt_tokens:,} tokens "
            f"({s.cached_tokens:,} loaded), "
            f"{rate:,.0f} tokens/s computed" + ("\n" if final else "")
        )
        self.out.flush()


def prompt_ids(tok: Any, text: str, args: argparse.Namespace, max_len: int, summary: Summary) -> list[int]:
    body = args.prefix + text
    if args.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": body}], tokenize=True, add_generation_prompt=False)
    else:
        ids = tok(body, add_special_tokens=True)["input_ids"]
    ids = list(ids)
    if len(ids) > max_len:
        summary.truncated += 1
        ids = ids[:max_len]
    return ids


def _batches(first: str, docs: Iterator[str], args: argparse.Namespace) -> Iterator[list[str]]:
    """``first`` and then ``docs`` in batches of ``--batch``, at most ``--limit`` documents."""
    batch = [first]
    n = 1
    for d in docs:
        if args.limit is not None and n >= args.limit:
            break
        if len(batch) == args.batch:
            yield batch
            batch = []
        batch.append(d)
        n += 1
    yield batch


def _start_llm(args: argparse.Namespace) -> Any:
    """A vLLM ``LLM`` with this connector on ``--config``, prefix caching off (every hit
    is the connector's)."""
    from vllm import LLM

    from .transfer_config import kv_transfer_config

    kw: dict[str, Any] = {}
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    return LLM(
        model=str(args.model),
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config({"config_file": str(args.config)}),
        **kw,
    )


def _count(summary: Summary, prompts: list[list[int]], outs: list[Any], chunk_size: int) -> None:
    """Add one batch's documents, prompt and cached tokens to ``summary``."""
    for p, o in zip(prompts, outs):
        cached = int(o.num_cached_tokens or 0)
        summary.documents += 1
        summary.prompt_tokens += len(p)
        summary.cached_tokens += cached
        # computed at most the part after the last whole chunk: everything storable was cached
        summary.fully_cached += cached > 0 and len(p) - cached <= chunk_size


def _to_prefill(engine: Any, prompts: list[list[int]], summary: Summary) -> list[list[int]]:
    """The prompts that need a prefill: those with a whole chunk no tier holds; the
    others are counted as skipped (every whole chunk stored) or too short."""
    from lmcache_core.keys import chain_seed, chunk_hashes

    seed = chain_seed({})
    todo = []
    for p in prompts:
        hashes = chunk_hashes(p, engine.chunk_size, seed=seed)
        if hashes and engine.lookup_hashes(hashes, record=False) < len(hashes):
            todo.append(p)
            continue
        summary.documents += 1
        summary.prompt_tokens += len(p)
        summary.skipped_tokens += len(p)
        if hashes:
            summary.skipped += 1
        else:
            summary.too_short += 1
    return todo


def warm(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> Summary:
    """Prefill every document of the corpus once; the :class:`Summary`."""
    if args.batch < 1:
        raise CorpusError(f"--batch must be at least 1, got {args.batch}")
    _tiers_outlive_us(args.config)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from .connector import LMCacheCoreConnector
    from .transfer_config import tokens_prompt

    summary = Summary()
    docs = read_corpus(args, summary, err)
    first = next(docs, None)  # corpus errors before vLLM starts
    if first is None:
        raise CorpusError("the corpus has no document")
    llm = _start_llm(args)
    connector = get_kv_transfer_group()
    assert isinstance(connector, LMCacheCoreConnector) and connector.worker is not None
    worker = connector.worker
    tok = llm.get_tokenizer()
    max_len = llm.llm_engine.model_config.max_model_len - 1
    sp = SamplingParams(max_tokens=1, temperature=0)
    progress = Progress(err, not args.quiet)
    t0 = time.perf_counter()
    try:
        for batch in _batches(first, docs, args):
            prompts = _to_prefill(worker.engine, [prompt_ids(tok, d, args, max_len, summary) for d in batch], summary)
            if not prompts:
                progress.update(summary)
                continue
            outs = llm.generate([tokens_prompt(p) for p in prompts], sp, use_tqdm=False)
            _count(summary, prompts, outs, worker.cfg.chunk_size)
            progress.update(summary)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        if worker.engine is not None:
            worker.engine.flush(timeout=120)  # background writes reach the slower tiers
            summary.tiers = list(worker.engine.stats()["tiers"])  # type: ignore[call-overload]
        summary.seconds = time.perf_counter() - t0
        progress.update(summary, final=True)
        llm.llm_engine.engine_core.shutdown()
    return summary


def report(s: Summary, out: TextIO) -> None:
    out.write(
        f"warm: {s.documents} documents, {s.prompt_tokens:,} prompt tokens in {s.seconds:.1f} s: "
        f"{s.computed_tokens:,} computed, {s.cached_tokens:,} already cached "
        f"({s.fully_cached} documents fully cached); {s.skipped} documents already stored, not prefilled"
        + (f"; {s.too_short} shorter than a chunk, not prefilled" if s.too_short else "")
        + (f"; {s.truncated} cut to the context length" if s.truncated else "")
        + (f"; {s.bad_lines} bad corpus lines skipped" if s.bad_lines else "")
        + ("; INTERRUPTED (what was stored is kept)" if s.interrupted else "")
        + "\n"
    )
    for t in s.tiers:
        out.write(
            f"  {t.get('name')}: {t.get('chunks', 0)} chunks, {int(t.get('bytes_used', 0)) / 2**20:.1f} MiB held, "
            f"{int(t.get('put_bytes', 0)) / 2**20:.1f} MiB written\n"
        )


def run(args: argparse.Namespace) -> int:
    try:
        s = warm(args)
    except CorpusError as e:
        sys.stderr.write(f"warm: {e}\n")
        return 2
    report(s, sys.stdout)
    return 130 if s.interrupted else 0
