"""``lmcache-core demo``: the main job, end to end on real vLLM.

Builds a small local model (random weights, local tokenizer), starts vLLM with the
connector on the embedded default config (CPU tier only), asks about several long
documents twice each, and prints time to first token cold vs warm per request, the
tokens lmcache-core loaded, and bytes per tier.

vLLM's own prefix cache is off by default so every warm hit shown comes from
lmcache-core (``--vllm-prefix-cache`` turns it on: then vLLM serves what still fits in
its own KV cache, and lmcache-core what was evicted from it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from ..transfer_config import tokens_prompt
from .tiny_model import DEMO_SPEC, TinyModelSpec, build_tiny_model, random_prompt

QUICK_SPEC = TinyModelSpec(
    hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096
)


def setup_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``lmcache-core demo`` (registered in :mod:`.plugin`): adds the demo's arguments."""
    p.add_argument("--docs", type=int, default=4, help="number of documents (default 4)")
    p.add_argument("--doc-tokens", type=int, default=3000, help="tokens per document (default 3000)")
    p.add_argument("--model-dir", type=Path, default=None, help="where to build the model (default ~/.cache/lmcache-core)")
    p.add_argument("--config", type=Path, default=None, help="lmcache-core YAML config (default: embedded CPU tier)")
    p.add_argument("--vllm-prefix-cache", action="store_true", help="also enable vLLM's own prefix cache")
    p.add_argument("--quick", action="store_true", help="smaller model and documents (about a minute)")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM's own output (INFO logs) on the terminal")
    return run


@contextmanager
def _output_to(log: Path | None) -> Iterator[TextIO]:
    """With ``log``, send everything written to this process's stdout and stderr
    (vLLM's logs, warnings, C++ messages) to that file; yields a stream on the real
    terminal for the demo's own lines. Without ``log``, the terminal as is."""
    if log is None:
        yield sys.stdout
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    try:
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        terminal.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _start_vllm(model_dir: Path, doc_tokens: int, args: argparse.Namespace) -> tuple[Any, Any]:
    """vLLM on CPU with the connector; returns the LLM and the connector's worker side."""
    from vllm import LLM
    from ..transfer_config import kv_transfer_config
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    extra: dict[str, Any] = {}
    if args.config is not None:
        extra["config_file"] = str(args.config)
    llm = LLM(
        model=str(model_dir),
        enforce_eager=True,
        max_model_len=doc_tokens + 256,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=args.vllm_prefix_cache,
        use_tqdm_on_load=args.verbose,
        kv_transfer_config=kv_transfer_config(extra),
    )
    from ..connector import LMCacheCoreConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, LMCacheCoreConnector) and connector.worker is not None
    return llm, connector.worker


def _intro(
    spec: TinyModelSpec, n_docs: int, doc_tokens: int, model_dir: Path, log: Path | None, args: argparse.Namespace
) -> None:
    print(
        f"lmcache-core demo: {n_docs} documents of {doc_tokens} tokens, each asked two questions on vLLM (CPU)\n"
        "with the lmcache-core connector. The first question computes the document's KV and stores it\n"
        "(cold); the second finds it in lmcache-core and loads it instead of recomputing it (warm).\n"
        f"model: {spec.tag()}, {spec.dtype}, random weights, built locally in {model_dir}\n"
        f"config: {args.config or 'embedded default (CPU tier)'}; vLLM's output: "
        + ("below (-v)" if log is None else f"{log} (-v shows it here)")
        + "\n",
        flush=True,
    )


Results = dict[tuple[int, int], tuple[float, int, int]]
"""(document, question) -> (TTFT in s, tokens vLLM reported cached, tokens lmcache loaded)."""


def _ask_twice(
    llm: Any, worker: Any, spec: TinyModelSpec, n_docs: int, doc_tokens: int, out: TextIO
) -> tuple[list[list[int]], Results]:
    """Ask two questions of each document: every first (cold) one, then every second (warm)."""
    from tqdm import tqdm
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0)
    docs = [random_prompt(doc_tokens, 1000 + d, spec.vocab_size) for d in range(n_docs)]
    questions = [[random_prompt(24, 5000 + d * 2 + q, spec.vocab_size) for q in range(2)] for d in range(n_docs)]
    plan = [(d, q) for q in range(2) for d in range(n_docs)]  # all cold first, then all warm
    results: Results = {}
    llm.generate([tokens_prompt(random_prompt(64, 1))], sp, use_tqdm=False)  # warm-up
    for d, q in tqdm(plan, desc="requests (cold pass, then warm)", unit="req", file=out):
        before = worker.stats()["loaded_tokens"]
        t = time.perf_counter()
        generated = llm.generate([tokens_prompt(docs[d] + questions[d][q])], sp, use_tqdm=False)
        ttft = time.perf_counter() - t
        results[(d, q)] = (ttft, generated[0].num_cached_tokens or 0, worker.stats()["loaded_tokens"] - before)
    return docs, results


def _report(docs: list[list[int]], results: Results, stats: Any, chunk_size: int, prefix_cache: bool) -> None:
    n_docs = len(docs)
    rows = []
    for d in range(n_docs):
        cold, warm = results[(d, 0)], results[(d, 1)]
        rows.append(
            [
                f"doc {d + 1}",
                str(len(docs[d]) + 24),
                f"{cold[0] * 1000:.0f}",
                f"{warm[0] * 1000:.0f}",
                f"{cold[0] / warm[0]:.1f}x",
                str(warm[1]),
                str(warm[2]),
            ]
        )
    print()
    print(_table(rows, ["request", "prompt tok", "cold TTFT ms", "warm TTFT ms", "speed-up", "cached tok", "loaded by lmcache"]))
    print()
    tier_rows = [
        [
            t["name"],
            str(t["chunks"]),
            _fmt_bytes(t["bytes_used"]),
            _fmt_bytes(t["put_bytes"]),
            _fmt_bytes(t["get_bytes"]),
            str(t["evictions"]),
        ]
        for t in stats["tiers"]
    ]
    print(_table(tier_rows, ["tier", "chunks", "bytes held", "bytes written", "bytes read", "evictions"]))
    total_cold = sum(results[(d, 0)][0] for d in range(n_docs))
    total_warm = sum(results[(d, 1)][0] for d in range(n_docs))
    print(
        f"\nmean TTFT cold {total_cold / n_docs * 1000:.0f} ms, warm {total_warm / n_docs * 1000:.0f} ms "
        f"({total_cold / total_warm:.1f}x); vLLM prefix cache {'on' if prefix_cache else 'off'}, "
        f"chunk size {chunk_size} tokens"
    )


def run(args: argparse.Namespace) -> int:
    # In-process engine: the demo reads the connector's counters directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    spec = QUICK_SPEC if args.quick else DEMO_SPEC
    n_docs = max(1, args.docs if not args.quick else min(args.docs, 3))
    doc_tokens = args.doc_tokens if not args.quick else min(args.doc_tokens, 1500)
    model_dir = args.model_dir or Path.home() / ".cache" / "lmcache-core" / spec.tag()
    log = None if args.verbose else model_dir.parent / "demo-vllm.log"
    _intro(spec, n_docs, doc_tokens, model_dir, log, args)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
    t0 = time.perf_counter()
    try:
        with _output_to(log) as out:
            out.write("building the model and starting vLLM ... ")
            out.flush()
            build_tiny_model(model_dir, spec)
            llm, worker = _start_vllm(model_dir, doc_tokens, args)
            out.write(f"done in {time.perf_counter() - t0:.0f} s\n")
            docs, results = _ask_twice(llm, worker, spec, n_docs, doc_tokens, out)
            stats = worker.stats()["engine"]
            chunk_size = worker.cfg.chunk_size
            llm.llm_engine.engine_core.shutdown()
    except Exception:
        if log is not None:
            tail = log.read_text(errors="replace").splitlines()[-40:]
            sys.stderr.write("\nthe demo failed; the end of vLLM's output (" + str(log) + "):\n" + "\n".join(tail) + "\n")
        raise
    _report(docs, results, stats, chunk_size, args.vllm_prefix_cache)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_connector.dev.demo")
    command = setup_command(parser)
    return command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
