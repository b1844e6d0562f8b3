"""Greedy answers of two servers compared by their logprobs, as vLLM's own tests
compare two implementations (``check_logprobs_close``): identical tokens pass; where
the tokens first part, each side's token must be among the other side's top ``k``
(a near-tie that a float rounding can flip) and the comparison stops there (past it
the two continue from different text). Anything else is a real mismatch.

Why: on CPU, vLLM's float sums depend on how a step batches tokens (how many requests
are in flight, where a prefill is split, which prefix came from a cache), so greedy
answers of two correct servers part now and then, always at a near-tie; wrong KV
parts early and far from one.

Each verdict also carries the gaps at the divergence (on each side, the logprob of its
own token minus that of the other side's token: small for a near-tie) and ``drift``,
the largest difference between the two sides' logprobs of the same token at the same
position before it (the same text read twice: float noise only).

A request asks for them with ``logprobs_request(k)``; ``parse_logprobs`` reads the
``logprobs`` object of a /v1/completions choice (streamed pieces are appended)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

IDENTICAL, NEAR_TIE, MISMATCH = "identical", "near-tie", "mismatch"
KINDS = (IDENTICAL, NEAR_TIE, MISMATCH)


def logprobs_request(k: int = 5) -> dict[str, Any]:
    """The /v1/completions fields for the top ``k`` logprobs of every output token, by
    token id (``"token_id:N"``: no two tokens share a key, whatever their text)."""
    return {"logprobs": k, "return_tokens_as_token_ids": True}


def _token_id(key: str) -> int:
    if not key.startswith("token_id:"):
        raise ValueError(f"logprobs key {key!r} is not a token id: ask with return_tokens_as_token_ids")
    return int(key[len("token_id:") :])


@dataclass
class Answer:
    """A greedy answer: its tokens and, at each position, the top logprobs by token id
    (the chosen token among them)."""

    tokens: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)

    def extend(self, logprobs: dict[str, Any] | None) -> None:
        """Appends one ``logprobs`` object of a completion choice (a streamed piece or
        the whole answer)."""
        if not logprobs:
            return
        tokens = logprobs.get("tokens") or []
        tops = logprobs.get("top_logprobs") or [None] * len(tokens)
        chosen = logprobs.get("token_logprobs") or [None] * len(tokens)
        for tok, lp, top in zip(tokens, chosen, tops):
            tid = _token_id(tok)
            row = {_token_id(key): float(v) for key, v in (top or {}).items()}
            if lp is not None:
                row.setdefault(tid, float(lp))
            self.tokens.append(tid)
            self.top.append(row)


def parse_logprobs(logprobs: dict[str, Any] | None) -> Answer:
    a = Answer()
    a.extend(logprobs)
    return a


def _top_k(row: dict[int, float], k: int) -> set[int]:
    return {t for t, _ in sorted(row.items(), key=lambda kv: -kv[1])[:k]}


@dataclass
class Verdict:
    kind: str
    #: index of the first differing token (None when identical)
    position: int | None = None
    #: (this side's token, the other side's) at ``position``
    tokens: tuple[int, int] | None = None
    #: at ``position``, on each side: logprob of its own token minus that of the other
    #: side's token (None where that token is not in the side's logprobs)
    gaps: tuple[float | None, float | None] = (None, None)
    #: largest |logprob difference| of the same token at the same position before it
    drift: float = 0.0

    def describe(self) -> str:
        if self.kind == IDENTICAL:
            return f"identical (drift {self.drift:.3g})"
        g = ", ".join("absent" if x is None else f"{x:.4f}" for x in self.gaps)
        return f"{self.kind} at token {self.position}: {self.tokens}, gaps {g}, drift before it {self.drift:.3g}"


def compare(a: Answer, b: Answer, k: int = 5) -> Verdict:
    """``a`` against ``b`` (see the module's docstring). Answers of different lengths
    that agree as far as the shorter goes are identical up to there."""
    drift = 0.0
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        ra = a.top[i] if i < len(a.top) else {}
        rb = b.top[i] if i < len(b.top) else {}
        if x == y:
            if x in ra and x in rb:
                drift = max(drift, abs(ra[x] - rb[x]))
            continue
        gap_a = ra[x] - ra[y] if x in ra and y in ra else None
        gap_b = rb[y] - rb[x] if y in rb and x in rb else None
        near = x in _top_k(rb, k) and y in _top_k(ra, k)
        return Verdict(NEAR_TIE if near else MISMATCH, i, (x, y), (gap_a, gap_b), drift)
    return Verdict(IDENTICAL, drift=drift)


@dataclass
class Tally:
    """Verdicts counted; ``ok`` while none is a real mismatch."""

    counts: Counter[str] = field(default_factory=Counter)
    verdicts: list[tuple[str, Verdict]] = field(default_factory=list)

    def add(self, label: str, v: Verdict) -> Verdict:
        self.counts[v.kind] += 1
        self.verdicts.append((label, v))
        return v

    @property
    def ok(self) -> bool:
        return self.counts[MISMATCH] == 0

    def line(self) -> str:
        n = sum(self.counts.values())
        return f"{n} compared: {self.counts[IDENTICAL]} identical, {self.counts[NEAR_TIE]} near-tie, {self.counts[MISMATCH]} mismatch"

    def max_drift(self) -> float:
        """The largest drift of any answer: how far the two sides' logprobs of the same
        tokens moved apart (float noise: a small fraction of a nat)."""
        return max((v.drift for _, v in self.verdicts), default=0.0)

    def max_gap(self) -> float | None:
        """The largest gap at any near-tie (how near the near-ties were)."""
        gaps = [g for _, v in self.verdicts if v.kind == NEAR_TIE for g in v.gaps if g is not None]
        return max(gaps) if gaps else None

    def details(self) -> list[str]:
        """One line per answer that parted."""
        return [f"{label}: {v.describe()}" for label, v in self.verdicts if v.kind != IDENTICAL]
