"""Run one in-process vLLM engine with the connector in a fresh Python process:
``python -m tests.connector.engine_proc MODEL CONFIG_JSON PROMPTS_JSON [--hold]``.
Prints one line ``RESULT {"tokens": [...], "cached": [...], "stats": {...}}``; with
``--hold`` it then keeps the engine (and so its peer server) alive until stdin closes."""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> int:
    model, config, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=4096,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheCoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=config,
        ),
    )
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )
    worker = get_kv_transfer_group()._worker
    flushed = worker.engine.flush(60)
    stats = worker.stats()
    print(
        "RESULT " + json.dumps(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
                "flushed": flushed,
                "loaded_tokens": stats["loaded_tokens"],
                "tiers": [{k: t[k] for k in ("name", "hits", "puts")} for t in stats["engine"]["tiers"]],
            }
        ),
        flush=True,
    )
    if "--hold" in sys.argv:
        sys.stdin.read()
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
