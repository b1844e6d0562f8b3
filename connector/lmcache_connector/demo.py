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
from pathlib import Path
from typing import Any, Callable

from .tiny_model import DEMO_SPEC, TinyModelSpec, build_tiny_model, random_prompt

QUICK_SPEC = TinyModelSpec(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096)


def setup_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``lmcache-core demo`` (registered in :mod:`.plugin`): adds the demo's arguments."""
    p.add_argument("--docs", type=int, default=4, help="number of documents (default 4)")
    p.add_argument("--doc-tokens", type=int, default=3000, help="tokens per document (default 3000)")
    p.add_argument("--model-dir", type=Path, default=None, help="where to build the model (default ~/.cache/lmcache-core)")
    p.add_argument("--config", type=Path, default=None, help="lmcache-core YAML config (default: embedded CPU tier)")
    p.add_argument("--vllm-prefix-cache", action="store_true", help="also enable vLLM's own prefix cache")
    p.add_argument("--quick", action="store_true", help="smaller model and documents (about a minute)")
    return run


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


def run(args: argparse.Namespace) -> int:
    # In-process engine: the demo reads the connector's counters directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = QUICK_SPEC if args.quick else DEMO_SPEC
    n_docs = max(1, args.docs if not args.quick else min(args.docs, 3))
    doc_tokens = args.doc_tokens if not args.quick else min(args.doc_tokens, 1500)
    model_dir = args.model_dir or Path.home() / ".cache" / "lmcache-core" / spec.tag()
    print(f"[1/3] building the local model {spec.tag()} in {model_dir} ...", flush=True)
    t0 = time.perf_counter()
    build_tiny_model(model_dir, spec)
    print(f"      done in {time.perf_counter() - t0:.1f} s", flush=True)

    print("[2/3] starting vLLM (CPU) with LMCacheCoreConnector ...", flush=True)
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {}
    if args.config is not None:
        extra["config_file"] = str(args.config)
    max_len = doc_tokens + 256
    llm = LLM(
        model=str(model_dir),
        enforce_eager=True,
        max_model_len=max_len,
        max_num_batched_tokens=max(2048, 256),
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=args.vllm_prefix_cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheCoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )
    worker = get_kv_transfer_group()._worker
    sp = SamplingParams(max_tokens=1, temperature=0)

    docs = [random_prompt(doc_tokens, 1000 + d, spec.vocab_size) for d in range(n_docs)]
    questions = [[random_prompt(24, 5000 + d * 2 + q, spec.vocab_size) for q in range(2)] for d in range(n_docs)]
    plan = [(d, q) for q in range(2) for d in range(n_docs)]  # all cold first, then all warm
    results: dict[tuple[int, int], tuple[float, int, int]] = {}
    llm.generate([TokensPrompt(prompt_token_ids=random_prompt(64, 1))], sp, use_tqdm=False)  # warm-up
    print("[3/3] asking each document two questions (cold pass, then warm pass)", flush=True)
    for d, q in tqdm(plan, desc="requests", unit="req", file=sys.stdout):
        before = worker.stats()["loaded_tokens"]
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=docs[d] + questions[d][q])], sp, use_tqdm=False)
        ttft = time.perf_counter() - t
        results[(d, q)] = (ttft, out[0].num_cached_tokens or 0, worker.stats()["loaded_tokens"] - before)

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
    stats = worker.stats()["engine"]
    print()
    tier_rows = [
        [t["name"], str(t["chunks"]), _fmt_bytes(t["bytes_used"]), _fmt_bytes(t["put_bytes"]), _fmt_bytes(t["get_bytes"]), str(t["evictions"])]
        for t in stats["tiers"]
    ]
    print(_table(tier_rows, ["tier", "chunks", "bytes held", "bytes written", "bytes read", "evictions"]))
    total_cold = sum(results[(d, 0)][0] for d in range(n_docs))
    total_warm = sum(results[(d, 1)][0] for d in range(n_docs))
    print(
        f"\nmean TTFT cold {total_cold / n_docs * 1000:.0f} ms, warm {total_warm / n_docs * 1000:.0f} ms "
        f"({total_cold / total_warm:.1f}x); vLLM prefix cache {'on' if args.vllm_prefix_cache else 'off'}, "
        f"chunk size {worker.cfg.chunk_size} tokens"
    )
    llm.llm_engine.engine_core.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_connector.demo")
    command = setup_command(parser)
    return command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
