"""One tensor-parallel-2 vLLM engine (``mp`` executor, one worker process per rank) in a
fresh Python process: ``python -m tests.connector.tp_proc MODEL CONFIG_JSON|none
PROMPTS_JSON [LLM_KWARGS_JSON]``. Runs the prompts twice and prints ``RESULT {...}`` with the greedy tokens
and cached-token counts of each pass."""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, config, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    kw: dict = dict(
        model=model,
        enforce_eager=True,
        max_model_len=4096,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        seed=0,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=64 << 20,
    )
    if len(sys.argv) > 4:
        kw.update(json.loads(sys.argv[4]))
    if config != "none":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheCoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=json.loads(config),
        )
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=8, temperature=0)
    passes = []
    for _ in range(2):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        passes.append({"tokens": [list(o.outputs[0].token_ids) for o in outs], "cached": [o.num_cached_tokens for o in outs]})
    print("RESULT " + json.dumps(passes), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
