"""Build a small Llama-style model locally: a transformers config, random weights and
a byte-level BPE tokenizer trained here on text that ships with Python. No download;
deterministic for a given seed and Python installation.

Used by the tests, the demo and the benchmarks: vLLM runs it like any checkpoint, so
prefill cost and KV shapes are real even though the text it writes is noise. The
tokenizer reads any text (a standard OpenAI-API client's documents become distinct
token sequences), and token-id prompts (:func:`random_prompt`) work as before.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


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


SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the model config's bos/eos
TOKENIZER_VERSION = "bpe-bytelevel-stdlib-v1"
CORPUS_BYTES = 3 << 20


def corpus(limit: int = CORPUS_BYTES) -> list[str]:
    """English-heavy text that ships with every CPython: its standard library's source
    files (docstrings and comments), read in sorted order up to ``limit`` bytes."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for f in sorted(root.glob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on :func:`corpus`,
    saved as a fast tokenizer; ids 0-2 are ``<unk>``, ``<s>``, ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:  # a corpus too small for this many merges
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, the model {vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def build_tiny_model(path: str | Path, spec: TinyModelSpec = TEST_SPEC) -> Path:
    """Write config, random weights and tokenizer to ``path`` (reused when present)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    marker = path / "lmcache_tiny_model.json"
    identity = {**asdict(spec), "tokenizer": TOKENIZER_VERSION}
    if marker.exists() and json.loads(marker.read_text()) == identity:
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
    marker.write_text(json.dumps(identity))
    return path


def random_prompt(n_tokens: int, seed: int, vocab_size: int = TEST_SPEC.vocab_size) -> list[int]:
    """Token ids (avoiding the special tokens) for a reproducible random prompt."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n_tokens)]
