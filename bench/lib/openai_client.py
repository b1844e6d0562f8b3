"""The client side of the OpenAI-server benchmarks: prompts of exact token lengths
(``Texts``), streamed ``/v1/completions`` requests with the client's own first-token
and inter-token times (``complete``, ``run_requests``, ``run_chat``), and their
percentiles and summary."""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lib.divergence import Answer, logprobs_request


class Texts:
    """Text of exact token lengths for the model's tokenizer: random words from the
    tokenizer's own training text (so the prompts look like prose to it)."""

    def __init__(self, model: Path, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        from lmcache_connector.dev.tiny_model import corpus

        self.tok = AutoTokenizer.from_pretrained(model)
        words = sorted(set(re.findall(r"[A-Za-z]{3,12}", " ".join(corpus(1 << 20)))))
        self.words = words
        self.rng = random.Random(seed)

    def text(self, n_tokens: int) -> str:
        """About ``n_tokens`` tokens of text (exact after encoding and decoding)."""
        words = " ".join(self.rng.choice(self.words) for _ in range(n_tokens))
        ids = self.tok(words, add_special_tokens=False)["input_ids"][:n_tokens]
        return self.tok.decode(ids)

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])


@dataclass
class Result:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    #: prompt tokens the server did not compute (usage.prompt_tokens_details.cached_tokens:
    #: the server needs --enable-prompt-tokens-details; 0 without it)
    cached_tokens: int = 0
    text: str = ""
    error: str | None = None
    #: the answer's token ids and top logprobs (asked with ``complete(..., logprobs=k)``)
    answer: Answer | None = None


async def complete(session: Any, base: str, model: str, prompt: str, max_tokens: int, logprobs: int | None = None) -> Result:
    """One streamed /v1/completions request; with ``logprobs``, the answer's tokens and
    their top ``logprobs`` logprobs in ``Result.answer`` (lib.divergence compares them)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if logprobs is not None:
        body.update(logprobs_request(logprobs))
    r = Result(answer=Answer() if logprobs is not None else None)
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    r.output_tokens = msg["usage"].get("completion_tokens", r.output_tokens)
                    r.cached_tokens = int((msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for ch in msg.get("choices", []):
                    # a choice is a token, even one whose text is empty (the detokenizer
                    # holds back a partial character, or the token has no text): the
                    # first one ends the TTFT, whatever it says
                    now = time.perf_counter()
                    if r.ttft == 0.0:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
                    r.text += ch.get("text") or ""
                    if r.answer is not None:
                        r.answer.extend(ch.get("logprobs"))
    except Exception as err:  # a failed request is counted, never fatal
        r.error = f"{type(err).__name__}: {err}"
    r.latency = time.perf_counter() - t0
    return r


async def run_requests(base: str, model: str, prompts: list[tuple[str, int]], concurrency: int) -> tuple[list[Result], float]:
    """Send ``prompts`` (text, max_tokens) in order, ``concurrency`` in flight."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(p: tuple[str, int]) -> Result:
            async with sem:
                return await complete(session, base, model, p[0], p[1])

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - t0


async def run_chat(
    base: str, model: str, users: list[list[str]], system: str, answer_tokens: int, concurrency: int
) -> tuple[list[Result], float]:
    """Multi-turn chat: each user's turns in order (history + answer + new message),
    ``concurrency`` users at a time."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    results: list[Result] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def user(turns: list[str]) -> None:
            async with sem:
                history = system
                for msg in turns:
                    history += "\nUser: " + msg + "\nAssistant:"
                    r = await complete(session, base, model, history, answer_tokens)
                    results.append(r)
                    history += r.text

        t0 = time.perf_counter()
        await asyncio.gather(*(user(t) for t in users))
        return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    itl = [x for r in ok for x in r.itl]
    ttft = [r.ttft for r in ok if r.ttft > 0]  # a request that streamed no token has none
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": round(wall, 2),
        "req_per_s": round(len(ok) / wall, 3) if wall else 0.0,
        "out_tok_per_s": round(sum(r.output_tokens for r in ok) / wall, 1) if wall else 0.0,
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "itl_ms": [round(x * 1e3, 2) for x in itl],  # every gap, for percentiles pooled over rounds
        "errors": sorted({r.error for r in results if r.error})[:3],
    }
