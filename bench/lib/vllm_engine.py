"""One in-process vLLM engine (CPU) per system compared: ``recompute`` (no connector),
``example`` (vLLM's ExampleConnector), ``lmcache`` (this connector) and
``vllm-prefix-cache`` (vLLM's own cache); the TTFT of one prompt; a clean shutdown.
``SPEC`` is the model bench_connector and bench_canary run. Importing this module sets
vLLM's environment defaults (one process, quiet tokenizers) before vLLM is imported."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lmcache_connector.dev.tiny_model import TinyModelSpec  # noqa: E402

SPEC = TinyModelSpec(
    hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096
)


def engine(
    model: Path,
    system: str,
    tmp: Path,
    max_len: int,
    *,
    kv_bytes: int = 256 << 20,
    prefix_caching: bool | None = None,
    extra: dict[str, Any] | None = None,
    max_num_seqs: int | None = None,
) -> Any:
    """A vLLM engine for ``system`` (``recompute``, ``example``, ``lmcache`` or
    ``vllm-prefix-cache``). ``prefix_caching`` overrides the default (on only for
    ``vllm-prefix-cache``); ``extra`` is the connector's ``kv_connector_extra_config``."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from lmcache_connector.transfer_config import kv_transfer_config

    kw: dict[str, Any] = dict(
        model=str(model),
        enforce_eager=True,
        dtype="float32",  # bf16 is emulated (slow) on CPUs without AVX512-BF16
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=system == "vllm-prefix-cache" if prefix_caching is None else prefix_caching,
        seed=0,
    )
    if max_num_seqs is not None:
        kw["max_num_seqs"] = max_num_seqs
    if system == "example":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(tmp / "example")},
        )
    elif system == "lmcache":
        kw["kv_transfer_config"] = kv_transfer_config(extra)
    return LLM(**kw)


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - t, out[0].num_cached_tokens


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
