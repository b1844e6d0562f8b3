"""bench_warm's visits ask different questions so that no visit loads a chunk another
visit stored: past the warmed document their prompts share no token, with the bench's
own model and tokenizer, and have the same length. The negative control: a question
that varies in its middle (the form that let the second visit reuse the first's
chunks) is caught."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_warm as bw  # noqa: E402


def test_the_visits_questions_share_nothing_past_the_document() -> None:
    from transformers import AutoTokenizer

    model = bw.build_model()
    tok = AutoTokenizer.from_pretrained(model)
    with tempfile.TemporaryDirectory() as d:
        docs = bw.corpus(model, 40, 300, Path(d) / "corpus.jsonl")
    assert len(set(bw.QUESTIONS)) == len(bw.QUESTIONS) == 3
    assert {bw.shared_past_document(tok, doc) for doc in docs} == {(0, 0)}
    middle = tuple(f"\nQuestion {n}: what is the document above about?\nAnswer:" for n in (1, 2, 3))
    shared = [bw.shared_past_document(tok, doc, middle)[0] for doc in docs]
    assert min(shared) > 0, shared
