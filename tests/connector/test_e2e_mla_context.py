"""An MLA (DeepSeek-V2) hit that leaves many prompt tokens to compute, on real vLLM (CPU).

Without AMX, vLLM-CPU runs MLA models on its reference backend (CPU_MLA) and turns
chunked prefill and prefix caching off for them (``vllm/platforms/cpu.py``), yet the
connector's hits make vLLM prefill the rest of a prompt *after* loaded context. That
path is vLLM's own context prefill (``MLACommonImpl.forward_mha`` with chunked context:
``_compute_prefill_context`` gathers the cached latents with
``gather_mla_context_cache_cpu``, ``CPUSDPAMLAPrefillBackend.run_prefill_context_chunk``
attends to them, ``merge_attn_states`` merges with the new tokens' attention), so a hit
must give exactly what vLLM gives when it splits the same prompt at the same token
itself. The reference here is that: vLLM without the connector, with chunked prefill
forced back on and a 1280-token step budget, so a 1380-token prompt is prefilled as
1280 tokens, then 100 with the first 1280 as context, as after the connector's hit.

Neither equals a one-step prefill of the whole prompt exactly: on vLLM-CPU 0.32 the MLA
query/key rope (the ``_C.rotary_embedding`` CPU kernel, called on strided views) gives
outputs that depend on how many tokens a step holds, so the same prompt batched with
another one moves the first token's logprobs by up to 0.23 and flips its greedy token
(measured on an AVX2-only AMD EPYC, fp32), with or without the connector; see
docs/connector.md (MLA).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from .conftest import make_llm, run, worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONTEXT = 1280  # tokens the connector serves (5 chunks of 256)
NEW = 100  # tokens vLLM computes after them


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmcache_connector.dev.tiny_hybrid import build_hybrid_model

    return build_hybrid_model(tmp_path_factory.mktemp("mla") / "deepseek_v2", "deepseek_v2")


@contextmanager
def _vllm_splits_at(budget: int) -> Iterator[None]:
    """vLLM-CPU engines started inside prefill in steps of ``budget`` tokens: chunked
    prefill back on for MLA models (the platform turns it off)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def patched(cls: Any, vllm_config: Any) -> None:
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.enable_chunked_prefill = True
        vllm_config.scheduler_config.max_num_batched_tokens = budget

    CpuPlatform.check_and_update_config = classmethod(patched)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original  # type: ignore[method-assign]


def _outputs(llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Greedy tokens, their logprobs and the first token's top 5, one prompt at a time
    (each alone in its steps)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=5)
    out = []
    for p in prompts:
        (o,) = run(llm, [p], sp)
        toks = list(o.outputs[0].token_ids)
        out.append(
            {
                "tokens": toks,
                "logprobs": [lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs)],
                "first_top5": {t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()},
                "cached": o.num_cached_tokens,
            }
        )
    return out


@pytest.mark.parametrize("dtype", ["auto", "float32"])  # auto: vLLM downcasts to bf16
def test_mla_hit_then_many_tokens_matches_vllm_own_split(mla_model: Path, dtype: str) -> None:
    from lmcache_connector.dev.tiny_hybrid import random_prompt

    import torch

    # vLLM-CPU turns chunked prefill and prefix caching off for MLA without AMX (the case
    # this test is about); with AMX they stay on and the comparison holds all the same
    reference_backend = not torch.cpu._is_amx_tile_supported()
    contexts = [random_prompt(CONTEXT, 900 + i) for i in range(2)]
    tail = random_prompt(NEW, 903)
    prompts = [c + tail for c in contexts]

    with _vllm_splits_at(CONTEXT), make_llm(mla_model, connector=False, dtype=dtype) as llm:
        sched = llm.llm_engine.vllm_config.scheduler_config
        assert sched.enable_chunked_prefill and sched.max_num_batched_tokens == CONTEXT
        if reference_backend:
            assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
        split_ref = _outputs(llm, prompts)

    with make_llm(mla_model, dtype=dtype) as llm:
        if reference_backend:
            assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill is False
        _outputs(llm, contexts)  # computed and stored
        hit = _outputs(llm, prompts)
        assert [h["cached"] for h in hit] == [CONTEXT, CONTEXT]
        assert worker().totals.loaded_tokens == 2 * CONTEXT and worker().totals.failed_loads == 0

    # Exactly what vLLM computes at the same split: tokens and logprobs to the bit.
    for h, r in zip(hit, split_ref):
        assert h["tokens"] == r["tokens"]
        assert h["logprobs"] == r["logprobs"]
        assert h["first_top5"] == r["first_top5"]
    # The loaded context is read: the same 100 new tokens after another context give
    # another distribution (a prefill that ignored the context would give the same).
    assert hit[0]["first_top5"] != hit[1]["first_top5"]
