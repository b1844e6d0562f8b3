"""Small hybrid and sliding-window models built locally (random weights, the same
word-level tokenizer as :mod:`lmcache_connector.dev.tiny_model`): one per attention family
the connector supports beyond dense attention.

* ``gemma3``: Gemma 3 text, sliding-window layers interleaved with full attention;
* ``gpt_oss``: gpt-oss style, alternating sliding/full attention with sinks, MoE;
* ``granite_hybrid``: GraniteMoeHybrid, Mamba2 layers plus attention layers;
* ``qwen3_next``: Qwen3-Next, gated delta-net (linear attention) plus full attention
  (bf16, linear head dim 128: what vLLM's CPU kernels need);
* ``mistral_sw``: a dense Mistral whose every layer has a sliding window (one group);
* ``deepseek_v2``: DeepSeek-V2 with MLA (kv_lora_rank 512 + rope 64, what vLLM-CPU's
  MLA kernels need; vLLM forces block size 16).

Weights are scaled up from the usual initialisation so greedy outputs vary with the
prompt instead of collapsing onto one token; tests compare outputs token by token.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .tiny_model import TOKENIZER_VERSION, random_prompt, write_tokenizer

__all__ = ["FAMILIES", "HybridSpec", "build_hybrid_model", "random_prompt"]


@dataclass(frozen=True)
class HybridSpec:
    family: str
    vocab_size: int = 2048
    sliding_window: int = 128
    dtype: str = "float32"
    std: float = 0.05
    seed: int = 0


FAMILIES: dict[str, HybridSpec] = {
    "gemma3": HybridSpec("gemma3", sliding_window=160),
    "gpt_oss": HybridSpec("gpt_oss", sliding_window=128, dtype="bfloat16"),
    "granite_hybrid": HybridSpec("granite_hybrid", dtype="float32"),
    "qwen3_next": HybridSpec("qwen3_next", dtype="bfloat16"),
    "mistral_sw": HybridSpec("mistral_sw", sliding_window=200),
    "deepseek_v2": HybridSpec("deepseek_v2"),
}


# DeepseekV2Config takes rope_scaling through **kwargs (not in its signature).
NO_ROPE_SCALING: dict[str, Any] = {"rope_scaling": None}


def _common(spec: HybridSpec) -> dict[str, Any]:
    """What every family's config shares: vocabulary, positions, special tokens."""
    return dict(
        vocab_size=spec.vocab_size,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def _gemma3(spec: HybridSpec) -> dict[str, Any]:
    return dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=spec.sliding_window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )


def _gpt_oss(spec: HybridSpec) -> dict[str, Any]:
    return dict(
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=spec.sliding_window,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )


def _granite_hybrid(spec: HybridSpec) -> dict[str, Any]:
    return dict(
        hidden_size=256,
        intermediate_size=512,
        shared_intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=0,
        num_experts_per_tok=0,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_expand=1,
        mamba_chunk_size=128,
        position_embedding_type="rope",
    )


def _qwen3_next(spec: HybridSpec) -> dict[str, Any]:
    return dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
    )


def _mistral_sw(spec: HybridSpec) -> dict[str, Any]:
    return dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=spec.sliding_window,
    )


def _deepseek_v2(spec: HybridSpec) -> dict[str, Any]:
    return dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        **NO_ROPE_SCALING,
    )


# family -> (its transformers config class, the family's own shape)
SHAPES: dict[str, tuple[str, Callable[[HybridSpec], dict[str, Any]]]] = {
    "gemma3": ("Gemma3TextConfig", _gemma3),
    "gpt_oss": ("GptOssConfig", _gpt_oss),
    "granite_hybrid": ("GraniteMoeHybridConfig", _granite_hybrid),
    "qwen3_next": ("Qwen3NextConfig", _qwen3_next),
    "mistral_sw": ("MistralConfig", _mistral_sw),
    "deepseek_v2": ("DeepseekV2Config", _deepseek_v2),
}


def _config(spec: HybridSpec) -> Any:
    """The transformers config of a tiny ``spec.family`` model."""
    if spec.family not in SHAPES:
        raise ValueError(f"unknown model family {spec.family!r}; known: {', '.join(FAMILIES)}")
    import transformers as tf

    cls, shape = SHAPES[spec.family]
    return getattr(tf, cls)(**shape(spec), **_common(spec))


def build_hybrid_model(path: str | Path, family: str | HybridSpec) -> Path:
    """Write config, random weights and tokenizer for ``family`` to ``path`` (reused
    when the marker file says the same spec is already there)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = FAMILIES[family] if isinstance(family, str) else family
    path = Path(path)
    marker = path / "lmcache_tiny_model.json"
    identity = {**asdict(spec), "tokenizer": TOKENIZER_VERSION}
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return path
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, spec.vocab_size)
    cfg = _config(spec)
    dtype = getattr(torch, spec.dtype)
    cfg.torch_dtype = dtype
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, spec.std)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(identity))
    return path
