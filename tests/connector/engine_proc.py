"""Run one in-process vLLM engine with the connector in a fresh Python process:
``python -m tests.connector.engine_proc MODEL CONFIG_JSON PROMPTS_JSON [--hold] [--llm JSON]``.
Prints one line ``RESULT {"tokens": [...], "cached": [...], "stats": {...}}``; with
``--hold`` it then keeps the engine (and so its peer server) alive until stdin closes.
``--llm`` overrides ``LLM(...)`` arguments (dtype, batch size, prefix caching); with
``"one_by_one": true`` the prompts are sent one request at a time."""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def engine(model: str, config: dict, role: str = "kv_both", **llm_kw: object) -> "Any":
    """The test engines' ``LLM``: in-process, CPU-sized, prefix caching off, the
    connector with ``config`` as its extra config and ``role`` as its kv_role."""
    from vllm import LLM
    from lmcache_connector.transfer_config import kv_transfer_config

    args: dict = dict(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=4096,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        seed=0,
    )
    args.update(llm_kw)
    return LLM(
        **args,
        kv_transfer_config=kv_transfer_config(config, role=role),
    )


def main() -> int:
    model, config, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm_kw = json.loads(sys.argv[sys.argv.index("--llm") + 1]) if "--llm" in sys.argv else {}
    one_by_one = llm_kw.pop("one_by_one", False)
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    gc.collect()  # vLLM's imports frozen: its collections while it builds the engine skip them
    gc.freeze()
    llm = engine(model, config, **llm_kw)
    sp = SamplingParams(max_tokens=8, temperature=0)
    batches = [[p] for p in prompts] if one_by_one else [prompts]
    outs = [o for batch in batches for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)]
    worker = get_kv_transfer_group().worker
    flushed = worker.engine.flush(60)
    stats = worker.stats()
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
                "flushed": flushed,
                "loaded_tokens": stats["loaded_tokens"],
                "chunk_size": worker.cfg.chunk_size,
                "hma_off": bool(llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager),
                "tiers": [
                    {"name": t["name"], "hits": t["hits"], "puts": t["puts"], "shm_hits": t["extra"].get("shm_hits", 0)}
                    for t in stats["engine"]["tiers"]
                ],
            }
        ),
        flush=True,
    )
    if "--hold" in sys.argv:
        sys.stdin.read()
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    rc = main()
    # The engine is shut down and its results printed; what is left is the interpreter's
    # teardown of vLLM's and torch's heap, about 3 s per process: skipped.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
