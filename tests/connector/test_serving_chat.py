"""A chat on vLLM's OpenAI server with a state-space hybrid (Qwen3-Next) and
``connector.save_decode_cache: prefill``: the settles run inside the engine-core
process, between turns, their outputs never reach the API server, and each turn hits
every whole chunk of the previous turn's prompt and answer with the tokens of vLLM
without the connector.

Controls: the reference is vLLM without the connector (its engine core in a process of
its own, with the server's threads: see the end of the test), fed the same prompts; the server's first turn hits nothing; turn 2's hit ends past turn 1's prompt
(so it holds answer chunks a settle stored); the in-process chat test
(test_e2e_hybrid.py) runs the same chat with prompts-only storage, which hits less."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import make_llm, random_prompt, run, stop_process, token_ids
from .test_serving_metrics import _free_port, _get, _metric, _post

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ANSWER = 128
# The connector's chunk: 256 tokens (chunk_size), or the smallest multiple of vLLM's
# block size for this model's gated delta-net layers above it when that block does not
# divide 256 (384 on the AVX-512 CPU CI ran on first; 256 on an AVX2-only AMD EPYC).
# Read from the state scheduler's start-up line in the server's log.
CHUNK_LINE = re.compile(r"lmcache-core: prefill steps end on (\d+)-token chunk boundaries")


def _chat_prompts(answers: list[list[int]]) -> list[int]:
    """The prompt of the next turn after ``answers`` (the same turns as test_e2e_hybrid's chat)."""
    prompt = random_prompt(740, 970)
    for turn, answer in enumerate(answers, start=1):
        prompt = prompt + answer + random_prompt(130, 971 + turn)
    return prompt


def test_server_chat_turns_hit_settled_answers(tmp_path: Path):
    from lmcache_connector.dev.tiny_hybrid import build_hybrid_model
    from lmcache_connector.state_scheduler import QUALNAME

    model = build_hybrid_model(tmp_path / "qwen3_next", "qwen3_next")
    port = _free_port()
    ktc = {
        "kv_connector": "LMCacheCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connector": {"save_decode_cache": "prefill"}},
    }
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    args += ["--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "4096", "--max-num-batched-tokens", "2048"]
    args += ["--scheduler-cls", QUALNAME, "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(ktc)]
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    base = f"http://127.0.0.1:{port}"
    prompts, answers, cached = [], [], []
    try:
        deadline = time.monotonic() + 420
        while True:
            if proc.poll() is not None:
                pytest.fail("server exited:\n" + log_path.read_text()[-4000:])
            try:
                _get(base + "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("server did not start in 420 s")
                time.sleep(1)
        for _turn in range(4):
            prompt = _chat_prompts(answers)
            body = {
                "model": str(model),
                "prompt": prompt,
                "max_tokens": ANSWER,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            out = _post(base + "/v1/completions", body, timeout=300)
            prompts.append(prompt)
            answers.append(list(out["choices"][0]["token_ids"]))
            cached.append(int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        text = ""
        for _ in range(60):  # the last turn's settle runs after its answer: wait until the engine is idle
            text = _get(base + "/metrics")
            if _metric(text, "vllm:num_requests_running") + _metric(text, "vllm:num_requests_waiting") == 0:
                break
            time.sleep(0.5)
    finally:
        stop_process(proc)
        log.close()
    found = CHUNK_LINE.search(log_path.read_text(errors="replace"))
    assert found, "the state scheduler's start-up line (its chunk size) is not in the server's log"
    chunk = int(found.group(1))
    assert chunk >= 256  # the default chunk_size, or the smallest multiple of vLLM's block size above it
    expect = [0] + [(len(p) + ANSWER - 1) // chunk * chunk for p in prompts[:-1]]
    assert cached == expect
    assert expect[1] > len(prompts[0]) // chunk * chunk  # turn 2 hit answer chunks, which only a settle stores
    assert _metric(text, "vllm:request_success_total") == 4  # the settles never reached the API server
    # every turn whose answer completes a chunk was settled, and /metrics says so
    settled = sum((len(p) + ANSWER - 1) // chunk > len(p) // chunk for p in prompts)
    assert settled >= 2 and _metric(text, "lmcache_core:settles_total") == settled
    assert _metric(text, "lmcache_core:settles_dropped_total") == _metric(text, "lmcache_core:settles_superseded_total") == 0
    serving = log_path.read_text(errors="replace").split("shutdown triggered")[0]  # vLLM's stop logs its own traceback
    assert "Traceback" not in serving and "not queued" not in serving and "ERROR" not in serving

    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True)
    # the reference prefills in steps ending on the same chunk boundaries (see test_e2e_hybrid),
    # and computes with the server's threads: its engine core in a process of its own, where
    # vLLM-CPU binds one OpenMP thread per core left after the reserved one. In this process
    # torch keeps a thread per core, whose sums differ in the last bf16 bit: greedy tokens then
    # part at exact or one-ulp ties (turns 2-4 did, 2026-11-29, while the server was bitwise
    # identical to a server without the connector and to this reference with one thread)
    with make_llm(model, connector=False, dtype="bfloat16", max_num_batched_tokens=chunk, multiprocess=True) as llm:
        assert token_ids([run(llm, [p], sp)[0] for p in prompts]) == answers
