"""Build a small Llama-style model locally: a transformers config, random weights and
a word-level tokenizer trained here. No download; deterministic for a given seed.

Used by the tests, the demo and the benchmarks: vLLM runs it like any checkpoint, so
prefill cost and KV shapes are real even though the text it writes is noise.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

WORDS_SEED = 1234


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position: int = 16384
    seed: int = 0
    #: the dtype the weights are saved in: vLLM's CPU build runs a model in bfloat16
    #: unless told otherwise, so the weights are saved that way (no casts, no warnings)
    dtype: str = "bfloat16"

    def tag(self) -> str:
        return (
            f"llama-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}-kv{self.num_kv_heads}"
            f"-d{self.head_dim}-v{self.vocab_size}-s{self.seed}"
        )


# Small enough for unit tests; the demo uses a larger one so prefill is measurable.
TEST_SPEC = TinyModelSpec()
DEMO_SPEC = TinyModelSpec(
    hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048, vocab_size=4096
)


def vocabulary(size: int) -> list[str]:
    """``size - 3`` pseudo-words plus the special tokens, the same in every process."""
    rng = random.Random(WORDS_SEED)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < size - 3:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))))
    return ["<unk>", "<s>", "</s>"] + sorted(words)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over :func:`vocabulary`, saved as a fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(vocab_size)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def build_tiny_model(path: str | Path, spec: TinyModelSpec = TEST_SPEC) -> Path:
    """Write config, random weights and tokenizer to ``path`` (reused when present)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    marker = path / "lmcache_tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return path
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, spec.vocab_size)
    cfg = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)  # drawn in float32, then rounded once to the saved dtype
    model.to(getattr(torch, spec.dtype)).save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(asdict(spec)))
    return path


def random_prompt(n_tokens: int, seed: int, vocab_size: int = TEST_SPEC.vocab_size) -> list[int]:
    """Token ids (avoiding the special tokens) for a reproducible random prompt."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n_tokens)]
