"""Chat turns on a state-space hybrid through vLLM's OpenAI server: what storing the
previous answer with ``connector.save_decode_cache: prefill`` (settles) gains, and what
it costs when no one follows up, for each ``connector.settle_when``.

    python bench/bench_hybrid_chat.py [--quick] [--rounds N] [--users 4] [--think 2.0] [--stagger 1.5] [--control]

Each arm is a fresh ``python -m vllm.entrypoints.openai.api_server`` (API process,
engine-core process) on 127.0.0.1 serving a small Qwen3-Next built on the spot (gated
delta-net + attention, bf16, random weights), prefix caching off, the state scheduler
(``--scheduler-cls``), ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``:

- ``lmc``: lmcache-core storing prompts only (``save_decode_cache: false``, the default);
- ``lmc-idle``: the same with ``save_decode_cache: prefill`` (``settle_when: idle``, the
  default: settles only while the engine has nothing else to do);
- ``lmc-always``: ``save_decode_cache: prefill``, ``settle_when: always`` (each settle as
  its request finishes);
- ``vllm``: vLLM alone (no connector, its own scheduler): every turn recomputed.

Three parts, each arm in turn, the arms' order rotating per round:

- ``chat``: ``--users`` conversations at once, ``--turns`` turns each: a first prompt of
  ``--first`` tokens, then each turn the history + the last answer (``--answer`` tokens,
  ``ignore_eos``) + a new message of ``--message`` tokens, ``--think`` seconds between a
  user's turns (a settle runs then). The users start together, so their turns end
  together and the engine idles while they all think. Streamed: TTFT is the client's.
  Printed: TTFT p50 of turns 2+, tokens served from the cache, and the greedy answers
  of each lmcache arm against ``lmc``'s: identical, near-tie or mismatch
  (``lib.divergence``: at the first differing token each side's token must be in the
  other's top-5 logprobs; a conversation is compared up to its first parting turn,
  its later prompts differ). With users in flight identical is not expected: the
  batches differ between arms (hits shorten prefills, settles join steps) and CPU
  float sums depend on the batch; a real mismatch fails the run. ``--control`` runs
  vLLM alone twice and compares the two.
- ``staggered``: the same conversations (other prompts), user ``u`` starting ``u x
  --stagger`` seconds late, so someone is nearly always decoding: what ``idle`` gives
  up under load.
- ``unique``: ``--unique`` single-turn prompts of ``--first`` tokens with answers of
  ``--answer`` tokens, ``--users`` at a time, nobody following up: the settles' cost,
  as throughput (output tokens/s) against ``lmc``, with the per-round ratios (on a
  shared host throughput moves by 10-20% between rounds).

Medians over rounds. Never part of the test pass.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.divergence import IDENTICAL, Answer, Tally, compare, logprobs_request  # noqa: E402
from lib.servers import free_port, healthy_process  # noqa: E402
from lmcache_connector.dev.tiny_hybrid import build_hybrid_model  # noqa: E402
from lmcache_connector.dev.tiny_model import random_prompt  # noqa: E402
from lmcache_connector.state_scheduler import QUALNAME  # noqa: E402

MODELS = Path.home() / ".cache" / "lmcache-core" / "bench-hybrid"
ARMS = ("lmc", "lmc-idle", "lmc-always", "vllm")
SETTLE_ARMS = {"lmc-idle": "idle", "lmc-always": "always"}
PARTS = ("chat", "staggered", "unique")


@contextmanager
def server(model: Path, arm: str, log_path: Path, start_timeout: float = 420) -> Iterator[int]:
    """A fresh OpenAI server for ``arm``; yields its port; stopped (bounded) on exit."""
    port = free_port()
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager"]
    args += [
        "--no-enable-prefix-caching",
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "2048",
        "--enable-prompt-tokens-details",
    ]
    if not arm.startswith("vllm"):
        when = SETTLE_ARMS.get(arm)
        connector: dict[str, Any] = {"save_decode_cache": "prefill", "settle_when": when} if when else {}
        ktc = {
            "kv_connector": "LMCacheCoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connector": connector},
        }
        args += ["--scheduler-cls", QUALNAME, "--kv-transfer-config", json.dumps(ktc)]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    health = f"http://127.0.0.1:{port}/health"
    with healthy_process(cmd, env=env, log_path=log_path, health_url=health, start_timeout=start_timeout, name=arm):
        yield port


def complete(port: int, model: Path, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: TTFT, the answer's token ids and top-5 logprobs, cached
    prompt tokens."""
    body = {
        **logprobs_request(5),
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = c.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft: float | None = None
    tokens: list[int] = []
    cached, answer = 0, Answer()
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        msg = json.loads(line[6:])
        for choice in msg.get("choices") or ():
            got = choice.get("token_ids") or []
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += got
            answer.extend(choice.get("logprobs"))
        usage = msg.get("usage")
        if usage:
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    c.close()
    if answer.tokens != tokens:
        raise RuntimeError("the logprobs' tokens are not the answer's")
    return {"ttft": ttft or 0.0, "tokens": tokens, "answer": answer, "cached": cached, "end": time.perf_counter() - t0}


def chat(port: int, model: Path, a: argparse.Namespace, stagger: float = 0.0, seed: int = 7000) -> dict[str, Any]:
    turns: list[list[dict[str, Any]]] = [[] for _ in range(a.users)]

    def user(u: int) -> None:
        time.sleep(u * stagger)
        prompt = random_prompt(a.first, seed + u)
        for t in range(a.turns):
            if t:
                time.sleep(a.think)
                prompt = prompt + turns[u][-1]["tokens"] + random_prompt(a.message, seed + 100 + 10 * u + t)
            turns[u].append(complete(port, model, prompt, a.answer))

    threads = [threading.Thread(target=user, args=(u,)) for u in range(a.users)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    later = [r for user_turns in turns for r in user_turns[1:]]
    return {
        "ttft_p50": statistics.median(r["ttft"] for r in later),
        "ttft_by_turn": [[round(r["ttft"] * 1000, 1) for r in ut] for ut in turns],
        "cached_by_turn": [[r["cached"] for r in ut] for ut in turns],
        "cached": sum(r["cached"] for r in later),
        "answers": [[r["tokens"] for r in ut] for ut in turns],
        "logprobs": [[r["answer"] for r in ut] for ut in turns],
        "wall": time.perf_counter() - t0,
    }


def unique(port: int, model: Path, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    prompts = [random_prompt(a.first, seed + i) for i in range(a.unique)]
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    todo = list(prompts)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop()
            r = complete(port, model, p, a.answer)
            with lock:
                out.append(r)

    threads = [threading.Thread(target=worker) for _ in range(a.users)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if any(r["cached"] for r in out):
        raise SystemExit("unique prompts hit the cache: not a no-reuse run")
    return {"tok_s": sum(len(r["tokens"]) for r in out) / wall, "wall": wall}


def compare_chats(base: list[list[list[Answer]]], other: list[list[list[Answer]]]) -> tuple[Tally, int]:
    """Every turn of ``other``'s conversations against ``base``'s, in order, each
    conversation up to its first turn that is not identical (its later prompts hold a
    different answer); also the turns left out that way."""
    tally, after = Tally(), 0
    for run, (b_run, o_run) in enumerate(zip(base, other)):
        for u, (b_turns, o_turns) in enumerate(zip(b_run, o_run)):
            for t, (x, y) in enumerate(zip(b_turns, o_turns)):
                if tally.add(f"part run {run + 1} user {u} turn {t + 1}", compare(y, x)).kind != IDENTICAL:
                    after += len(b_turns) - t - 1
                    break
    return tally, after


def _gaps(t: Tally) -> str:
    g = t.max_gap()
    gap = "no near-tie" if g is None else f"largest logprob gap at a near-tie {g:.4f}"
    return f"{gap}, largest drift {t.max_drift():.4f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, 2 users, 3 turns, 8 unique prompts")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the arms' order rotating (default 2)")
    p.add_argument("--users", type=int, default=4, help="chat users at a time (default 4)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--first", type=int, default=1500, help="tokens of a conversation's first message (default 1500)")
    p.add_argument("--message", type=int, default=130, help="tokens of each later message (default 130)")
    p.add_argument("--answer", type=int, default=256, help="tokens of each answer (default 256)")
    p.add_argument("--think", type=float, default=2.0, help="seconds a user waits between turns (default 2)")
    p.add_argument("--stagger", type=float, default=1.5, help="seconds between users' starts (staggered part)")
    p.add_argument("--unique", type=int, default=16, help="prompts of the unique part (default 16)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="lmc is always run (the base of every ratio)")
    p.add_argument(
        "--control",
        action="store_true",
        help="also run vLLM alone a second time (vllm-again) and compare its answers with the first run's",
    )
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "hybrid_chat"))
    a = p.parse_args()
    if a.quick:
        a.rounds, a.users, a.turns, a.unique = 1, 2, 3, 8
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_hybrid_model(MODELS / "qwen3_next", "qwen3_next")
    print(
        f"Qwen3-Next (tiny, bf16) on the OpenAI server; chat: {a.users} users x {a.turns} turns, first {a.first} tokens, "
        f"messages {a.message}, answers {a.answer}, think {a.think} s; unique: {a.unique} prompts x {a.first} tokens, "
        f"answers {a.answer}, {a.users} at a time; {a.rounds} round(s), the arms' order rotating",
        flush=True,
    )
    keys = ("chat", "chat_cached", "staggered", "staggered_cached", "tok_s")
    arms = tuple(arm for arm in ARMS if arm in a.arms or arm == "lmc")
    if a.control:
        arms = tuple(dict.fromkeys((*arms, "vllm", "vllm-again")))
    answers: dict[str, list[list[list[Answer]]]] = {arm: [] for arm in arms}  # per part run: [user][turn]
    res: dict[str, dict[str, list[Any]]] = {
        arm: {k: [] for k in (*keys, "answers", "chat_turns", "staggered_turns")} for arm in arms
    }
    for rnd in range(a.rounds):
        order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
        for arm in order:
            with server(model, arm, out / f"round{rnd + 1}-{arm}.log") as port:
                complete(port, model, random_prompt(64, 1), 4)  # warm-up
                line = f"  round {rnd + 1} {arm:<10}"
                for part, stagger, seed in (("chat", 0.0, 7000), ("staggered", a.stagger, 8000)):
                    if part in a.parts:
                        c = chat(port, model, a, stagger, seed)
                        res[arm][part].append(c["ttft_p50"])
                        res[arm][f"{part}_cached"].append(c["cached"])
                        res[arm]["answers"].append(c["answers"])
                        answers[arm].append(c["logprobs"])
                        res[arm][f"{part}_turns"].append({"ttft_ms": c["ttft_by_turn"], "cached": c["cached_by_turn"]})
                        line += f" {part}: TTFT p50 {c['ttft_p50'] * 1000:6.1f} ms, cached {c['cached']:>6};"
                if "unique" in a.parts:
                    u = unique(port, model, a, 9000 + 100 * rnd)
                    res[arm]["tok_s"].append(u["tok_s"])
                    line += f" unique: {u['tok_s']:6.1f} output tok/s"
                print(line, flush=True)
    med = {arm: {k: statistics.median(r[k]) for k in keys if r[k]} for arm, r in res.items()}
    (out / "results.json").write_text(json.dumps({"args": vars(a), "rounds": res, "medians": med}, indent=1))
    logprobs = {arm: [[[asdict(x) for x in ut] for ut in run] for run in runs] for arm, runs in answers.items()}
    (out / "logprobs.json").write_text(json.dumps(logprobs))
    print("\nmedians over rounds (TTFT p50 of turns 2+)")
    ok = True
    lmc_arms = [arm for arm in arms if not arm.startswith("vllm")]
    bases = [b for b in ("lmc", "vllm") if b in arms]
    for part in ("chat", "staggered"):
        if part not in a.parts:
            continue
        for arm in arms:
            print(f"  {part:<9} {arm:<10} {med[arm][part] * 1000:7.1f} ms, cached {med[arm][f'{part}_cached']:>8.0f} tokens")
        ratios = ", ".join(
            f"{arm} / {base} {med[arm][part] / med[base][part]:.3f}"
            for arm in arms
            if arm != "lmc"
            for base in bases
            if base != arm
        )
        print(f"  {part:<9} TTFT {ratios}")
        ok = ok and all(med[arm][f"{part}_cached"] >= med["lmc"][f"{part}_cached"] for arm in lmc_arms)
    if "chat" in a.parts or "staggered" in a.parts:
        # greedy answers against lmc's, each conversation up to its first parting turn;
        # identical is not expected with users in flight (see --control): a near-tie passes
        print("  answers against lmc's (top-5 logprobs at the first divergence; a conversation stops there):")
        for arm in lmc_arms[1:]:
            t, after = compare_chats(answers["lmc"], answers[arm])
            print(f"    {arm:<10} {t.line()}; {after} later turns not compared (their prompts differ); {_gaps(t)}")
            for d in t.details():
                print(f"      {d}")
            ok = ok and t.ok
        for arm, base in (("vllm", "lmc"), ("vllm-again", "vllm")):
            if arm in arms and base in arms:
                t, after = compare_chats(answers[base], answers[arm])
                role = "negative control" if arm == "vllm-again" else "for reference: vLLM's own scheduler"
                print(f"    {arm} / {base} ({role}): {t.line()}; {after} later turns not compared; {_gaps(t)}")
                for d in t.details():
                    print(f"      {d}")
    if "unique" in a.parts:
        ratios = ", ".join(f"{arm} / lmc {med[arm]['tok_s'] / med['lmc']['tok_s']:.3f}" for arm in arms if arm != "lmc")
        print(f"  unique throughput (the settles' cost without follow-ups): {ratios}")
        for arm in arms:
            if arm != "lmc":
                per = [x / y for x, y in zip(res[arm]["tok_s"], res["lmc"]["tok_s"])]
                print(f"    {arm} / lmc per round: {' '.join(f'{x:.3f}' for x in per)} (median {statistics.median(per):.3f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
