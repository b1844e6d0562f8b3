"""The generated models' tokenizer reads text: distinct documents become distinct token
sequences (a standard OpenAI-API client can drive the demo and the benches), decoding
gives the text back, the special tokens keep ids 0-2, and training is deterministic."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from lmcache_connector.dev.tiny_model import SPECIAL_TOKENS, TOKENIZER_VERSION, write_tokenizer


def test_tokenizer_reads_text_and_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_tokenizer(a, 1024)
    write_tokenizer(b, 1024)
    assert json.loads((a / "tokenizer.json").read_text()) == json.loads((b / "tokenizer.json").read_text())
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == SPECIAL_TOKENS and len(tok) == 1024
    docs = [
        "The committee reviewed the quarterly report and approved the budget.",
        "The committee reviewed the annual report and rejected the budget.",
        "Ünïcode, emoji 🙂 and tabs\tsurvive a byte-level round trip.",
    ]
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert len({tuple(i) for i in ids}) == 3 and all(0 not in i for i in ids)  # no <unk>
    assert [tok.decode(i) for i in ids] == docs
    # English compresses: fewer tokens than characters (a word-level vocabulary of
    # pseudo-words mapped all of this to <unk>)
    assert len(ids[0]) < 0.6 * len(docs[0])
    assert TOKENIZER_VERSION.startswith("bpe-")
