"""``connector.layerwise: true`` on real vLLM (CPU): loads go through the layer pipeline before
the forward pass, saves are gathered layer by layer as vLLM hands each attention layer
to ``save_kv_layer``, and vLLM's ``wait_for_layer_load`` calls are checked for every
layer (what the GPU path relies on to order the compute after each layer's copies).
Outputs stay token-identical to vLLM without a connector; the pipeline never had to
gather a layer late or turn itself off."""

from __future__ import annotations

import pytest

from .conftest import make_llm, random_prompt, run, token_ids, worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CS = 256


def test_layerwise_token_identical_and_layer_by_layer(tiny_model, reference):
    prefixes = [random_prompt(3 * CS, 700 + i) for i in range(2)]
    prompts = [prefixes[i % 2] + random_prompt(30 + 9 * i, 710 + i) for i in range(4)]
    ref = reference(prompts)
    with make_llm(tiny_model, max_num_batched_tokens=1024, extra={"connector": {"layerwise": True}}) as llm:
        w = worker()
        assert w.pipeline is not None and w.pipeline.num_layers == len(w.layout.layers)
        assert token_ids(run(llm, prompts)) == ref
        saved_cold = w.pipeline.pipelined_saves
        assert saved_cold >= 2 * 3  # the prefixes' chunks, gathered layer by layer
        warm = run(llm, prompts)
        assert token_ids(warm) == ref
        assert all(o.num_cached_tokens == 3 * CS for o in warm)
        st = w.stats()["layerwise"]
        assert st["active"], "vLLM skipped wait_for_layer_load for a layer, or named an unknown one"
        assert st["loaded_chunks"] >= 4 * 3 and st["late_save_layers"] == 0
        assert w.stats()["loaded_tokens"] >= 4 * 3 * CS
        assert w.engine.pins.ids() == set()
    # negative control: without the switch there is no pipeline, same tokens
    with make_llm(tiny_model, max_num_batched_tokens=1024) as llm:
        assert worker().pipeline is None
        run(llm, prompts)
        assert token_ids(run(llm, prompts)) == ref
