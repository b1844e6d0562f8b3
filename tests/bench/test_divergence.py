"""bench/lib/divergence.py, how the benchmarks judge two servers' greedy answers:
identical passes; at the first differing token each side's token must be in the other
side's top k (a near-tie) and the comparison stops there; anything else is a real
mismatch. Controls: a divergence to a token outside the other side's top k, on either
side, is a mismatch; a token present in the logprobs but ranked past k is outside;
what follows the first divergence is never judged. No server runs: the logprobs
objects are what /v1/completions returns with return_tokens_as_token_ids."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from lib.divergence import (  # noqa: E402
    IDENTICAL,
    MISMATCH,
    NEAR_TIE,
    Answer,
    Tally,
    compare,
    logprobs_request,
    parse_logprobs,
)


def _answer(rows: list[dict[int, float]]) -> Answer:
    """Greedy: each position's token is its row's best."""
    return Answer([max(r, key=lambda t: r[t]) for r in rows], rows)


def _rows(*best: int) -> list[dict[int, float]]:
    """One row per token: the token clearly first, four others behind."""
    return [{t: -0.1, t + 1: -3.0, t + 2: -4.0, t + 3: -5.0, t + 4: -6.0} for t in best]


def test_identical_answers_pass_and_report_their_drift() -> None:
    a = _answer(_rows(10, 20, 30))
    b = _answer(_rows(10, 20, 30))
    b.top[1][20] = -0.1003
    v = compare(a, b)
    assert v.kind == IDENTICAL and v.position is None
    assert v.drift == pytest.approx(0.0003)


def test_a_near_tie_is_where_each_token_is_in_the_others_top_k() -> None:
    rows_a = _rows(10, 20, 30)
    rows_b = _rows(10, 20, 30)
    rows_a[1] = {20: -0.70, 21: -0.71, 22: -3.0, 23: -4.0, 24: -5.0}
    rows_b[1] = {21: -0.70, 20: -0.72, 22: -3.0, 23: -4.0, 24: -5.0}
    # past the divergence the answers go apart: never judged
    rows_b[2] = {99: -0.1, 98: -3.0, 97: -4.0, 96: -5.0, 95: -6.0}
    v = compare(_answer(rows_a), _answer(rows_b))
    assert v.kind == NEAR_TIE and v.position == 1 and v.tokens == (20, 21)
    assert v.gaps[0] == pytest.approx(0.01) and v.gaps[1] == pytest.approx(0.02)


def test_negative_control_a_token_outside_the_others_top_k_is_a_mismatch() -> None:
    a = _answer(_rows(10, 20))
    b = _answer(_rows(10, 50))  # 50 is nowhere in a's row, nor 20 in b's
    v = compare(a, b)
    assert v.kind == MISMATCH and v.position == 1 and v.tokens == (20, 50)
    assert v.gaps == (None, None)
    # one side only is not enough: b's token is in a's top 5, a's is not in b's
    rows_a = _rows(10, 20)
    rows_b = _rows(10, 21)  # b's row: 21..25
    assert 21 in rows_a[1] and 20 not in rows_b[1]
    assert compare(_answer(rows_a), _answer(rows_b)).kind == MISMATCH
    assert compare(_answer(rows_b), _answer(rows_a)).kind == MISMATCH


def test_top_k_is_by_rank_not_by_presence() -> None:
    # the API returns the chosen token beside the top k: a sixth entry is not in the top 5
    rows_a = [{20: -0.5, 1: -1.0, 2: -1.1, 3: -1.2, 4: -1.3, 21: -1.4}]
    rows_b = [{21: -0.5, 20: -0.6, 5: -1.0, 6: -1.1, 7: -1.2}]
    assert compare(_answer(rows_a), _answer(rows_b), k=5).kind == MISMATCH
    assert compare(_answer(rows_a), _answer(rows_b), k=6).kind == NEAR_TIE


def test_parse_reads_token_ids_and_appends_streamed_pieces() -> None:
    assert logprobs_request(5) == {"logprobs": 5, "return_tokens_as_token_ids": True}
    piece1 = {
        "tokens": ["token_id:7"],
        "token_logprobs": [-0.2],
        "top_logprobs": [{"token_id:7": -0.2, "token_id:8": -1.9}],
    }
    piece2 = {
        "tokens": ["token_id:9", "token_id:4"],
        "token_logprobs": [-0.1, -0.3],
        "top_logprobs": [{"token_id:9": -0.1}, None],
    }
    a = parse_logprobs(piece1)
    a.extend(piece2)
    a.extend(None)
    assert a.tokens == [7, 9, 4]
    assert a.top == [{7: -0.2, 8: -1.9}, {9: -0.1}, {4: -0.3}]
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        parse_logprobs({"tokens": ["hello"], "token_logprobs": [-0.1], "top_logprobs": [{"hello": -0.1}]})


def test_tally_fails_on_a_mismatch_only() -> None:
    t = Tally()
    t.add("doc 0", compare(_answer(_rows(10, 20)), _answer(_rows(10, 20))))
    rows_b = _rows(10, 20)
    rows_b[1] = {21: -0.69, 20: -0.70, 22: -3.0, 23: -4.0, 24: -5.0}
    t.add("doc 1", compare(_answer(_rows(10, 20)), _answer(rows_b)))
    assert t.ok and t.line() == "2 compared: 1 identical, 1 near-tie, 0 mismatch"
    assert t.max_gap() == pytest.approx(2.9)  # a's side: -0.1 against 21's -3.0
    assert t.max_drift() == 0.0  # the tokens before the divergence had the same logprobs
    assert len(t.details()) == 1 and t.details()[0].startswith("doc 1: near-tie at token 1")
    t.add("doc 2", compare(_answer(_rows(10, 20)), _answer(_rows(10, 50))))
    assert not t.ok and t.counts[MISMATCH] == 1
