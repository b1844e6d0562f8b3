"""The connector in vLLM's default multiprocess mode: the engine core runs in its own
process, and with the ``mp`` executor the worker runs in yet another, so the
scheduler side's lookups cross a process boundary over ZMQ IPC."""

from __future__ import annotations

import pytest

from .conftest import make_llm, random_prompt, run, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_multiprocess_hit_token_identical(tiny_model, reference, executor):
    prompts = [random_prompt(900, 201), random_prompt(600, 202)]
    ref = reference(prompts)
    with make_llm(tiny_model, multiprocess=True, distributed_executor_backend=executor) as llm:
        cold = run(llm, prompts)
        assert token_ids(cold) == ref
        warm = run(llm, prompts)
        assert [o.num_cached_tokens for o in warm] == [768 + 128, 512]  # 900: 3 chunks and a block tail
        assert token_ids(warm) == ref
