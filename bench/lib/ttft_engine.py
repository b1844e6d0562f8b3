"""What the fresh-process TTFT benchmarks share (bench_disk_ttft.py, bench_node_ttft.py):
the tiny model they all run, one vLLM engine per child process built the same way,
TTFT per prompt, and the parent's side of running such a child.

A child is ``python <script> --child JOB.json``; it prints its result as one line
``RESULT <json>`` (vLLM logs to the same streams, so the parent looks for that line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

SPEC_KW = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096)
"""The model: 4 layers, 4 KV heads of 64, float32: 8 KiB of KV per token, 2 MiB per 256-token chunk."""


def tiny_model() -> tuple[Any, Path]:
    """The benchmark model's spec and its directory (built on first use)."""
    from lmcache_connector.dev.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(**SPEC_KW)
    return spec, build_tiny_model(Path.home() / ".cache" / "lmcache-core" / spec.tag(), spec)


def make_llm(model: str, kv_transfer_config: Any = None, *, max_len: int = 8192, kv_bytes: int = 512 << 20) -> Any:
    """One engine in this process, prefix caching off (every reuse is the connector's),
    prompts up to ``max_len`` tokens, ``kv_bytes`` of KV cache, warmed up on a prompt no
    benchmark reuses."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        enforce_eager=True,
        dtype="float32",
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config=kv_transfer_config,
    )
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 32)], SamplingParams(max_tokens=1), use_tqdm=False)
    return llm


def ttft(llm: Any, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Time to first token of each prompt, one request at a time, and its cached tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0)
    times, cached = [], []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
        cached.append(out[0].num_cached_tokens)
    return times, cached


def finish(llm: Any, result: Any, *, flush: bool) -> None:
    """Print the child's result line and shut the engine down; with ``flush`` first wait
    until the connector's slower tiers hold everything stored (so a later process finds it)."""
    if flush:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().worker.engine.flush(120)
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


def run_if_child(child: Callable[..., None]) -> bool:
    """In a child (``--child JOB.json``): run ``child(**job)`` and say so; else False."""
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(**json.loads(Path(sys.argv[2]).read_text()))
        return True
    return False


def run_child(script: str, job: dict[str, Any], what: str) -> Any:
    """Run ``script --child`` on ``job`` in a fresh interpreter; its RESULT."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        proc = subprocess.run([sys.executable, script, "--child", f.name], capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{what} process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
