"""Eviction policies side by side on production traces and the benchmark suite's
workloads, engine level, every figure a ratio measured in this one run.

    python bench/bench_eviction.py [--quick] [--policies lru,s3fifo,tinylfu,...] [--traces FILE ...]

**Traces** (``../shared/traces/``: the Mooncake FAST'25 conversation and synthetic
traces, or ``--traces``): each replayed with ``lmcache_core.replay`` (real engines,
one CPU tier, as the connector drives them) at 5, 10, 25 and 50% of its distinct
blocks, next to the offline optimum. Bars for the default policy: at least the hits
of every other policy at every size (the conversation trace's 10% and 25% and the
synthetic trace's 5-50% are the issue's); goal: 0.9 of the optimum on the
conversation trace at 10%. ``--quick`` replays each trace's first 3,000 requests: a
smoke run of another, shorter workload, so the trace bars (set on whole traces) are
printed there as ``PASS`` or ``MISS (quick)`` with the same figures and do not fail it.
The default policy's figures on traces vary with Python's hash seed (its shadows
sample keys by it): a run without ``PYTHONHASHSEED`` picks one, prints it, and
``PYTHONHASHSEED=N`` repeats that run.

**Cost** (``--no-cost`` skips it): microseconds per policy call at 100,000 resident
chunks, with ``--quick`` too (the bar is set there: at fewer chunks ``adaptive``'s
shadows sample a larger share of the keys, so a call costs more) in a CPU tier's call
order; bar: the default at most 2 us per call above ``lru``.

Replays the suite's request streams (``bench/suite/run.py``: round-robin doc QA,
multi-round chat) against a real :class:`~lmcache_core.engine.CacheEngine` with one
CPU tier, exactly as the connector drives it (lookup, load the hit prefix, store
the rest), with tiny chunk tensors so a whole sweep takes seconds. Hit rates are
token counts, as vLLM's ``num_cached_tokens`` would report them (a hit prefix stops
one token short of the prompt). The full vLLM sweep (``bench/suite/run.py
--sweep-only``) measures the same thing with TTFT; this one checks the bars fast:

- doc QA at 50% of the working set: warm hit rate of the checked policy (default:
  the default policy) >= 40% (an optimal policy serves about half);
- chat: never fewer hit tokens than LRU, at any size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "suite"))

from lmcache_core.config import CoreConfig  # noqa: E402
from lmcache_core.engine import CacheEngine  # noqa: E402
from lmcache_core.keys import KeyNamespace  # noqa: E402
from lmcache_core.local_cpu import DEFAULT_EVICTION  # noqa: E402
from lmcache_core.testing.tokens import token_hashes  # noqa: E402

CHUNK = 256
CHUNK_SHAPE = (64,)  # float32: 256 bytes per chunk; only counts matter here
CHUNK_BYTES = 64 * 4
FRACTIONS = (0.25, 0.5, 1.0, 2.0)


def workloads(quick: bool) -> dict[str, list[tuple[list[int], bool]]]:
    """The suite's sweep doc QA and chat request streams: (tokens, warm)."""
    from run import chat, docqa  # bench/suite/run.py

    vocab = 4096
    if quick:
        docs = docqa([1024, 1365, 1707, 2048], queries=2, vocab=vocab)
        conv = chat(users=3, rounds=4, vocab=vocab, system_tokens=256, turn_tokens=64, answer_tokens=96)
    else:
        docs = docqa([2048, 3277, 4506, 5734, 6963, 8192], queries=2, vocab=vocab)
        conv = chat(users=4, rounds=6, vocab=vocab, system_tokens=512, turn_tokens=96, answer_tokens=160)
    return {w.name: [(r.tokens, r.warm) for r in w.requests] for w in (docs, conv)}


def replay(requests: list[tuple[list[int], bool]], max_size: int, policy: str) -> dict[str, Any]:
    """Drive one engine like the connector does; token-level hit counts."""
    cfg = CoreConfig(
        chunk_size=CHUNK, backends=[{"name": "local_cpu", "max_size": max_size, "eviction": policy}], staging_size=1 << 20
    )
    prompt = cached = warm_prompt = warm_cached = 0
    with CacheEngine(cfg, namespace=KeyNamespace(model="bench-eviction")) as eng:
        for tokens, warm in requests:
            hashes = token_hashes(eng, tokens)
            n = eng.lookup_hashes(hashes)
            loaded = 0
            for h in hashes[:n]:
                buf = eng.retrieve_buffer(h, CHUNK_SHAPE, torch.float32)
                if buf is None:
                    break
                buf.release()
                loaded += 1
            hit = min(loaded * CHUNK, len(tokens) - 1)
            rest = hashes[loaded:]
            eng.store_hashes(rest, [torch.zeros(CHUNK_SHAPE) for _ in rest])
            prompt += len(tokens)
            cached += hit
            if warm:
                warm_prompt += len(tokens)
                warm_cached += hit
        tier = eng.stats()["tiers"][0]
        used = tier["bytes_used"]
    return {
        "hit_rate": cached / prompt,
        "warm_hit_rate": warm_cached / warm_prompt if warm_prompt else 0.0,
        "hit_tokens": cached,
        "bytes_used": used,
        "evictions": tier["evictions"],
    }


def sweep(quick: bool, policies: list[str]) -> list[dict[str, Any]]:
    points = []
    for name, reqs in workloads(quick).items():
        ws = replay(reqs, 64 << 20, "lru")["bytes_used"]  # what an unlimited tier holds
        for f in FRACTIONS:
            size = max(int(ws * f), CHUNK_BYTES)
            for p in policies:
                r = replay(reqs, size, p)
                points.append({"workload": name, "fraction": f, "policy": p, "working_set_bytes": ws, **r})
    return points


def check_bars(points: list[dict[str, Any]], policy: str) -> list[str]:
    """The issue's bars, as lines ``PASS``/``FAIL`` with the figures."""
    out = []
    by = {(p["workload"], p["fraction"], p["policy"]): p for p in points}
    d = by.get(("docqa", 0.5, policy))
    if d is not None:
        ok = d["warm_hit_rate"] >= 0.40
        out.append(
            f"{'PASS' if ok else 'FAIL'} doc QA at 50%: {policy} serves {d['warm_hit_rate'] * 100:.1f}% of warm tokens (bar >= 40%)"
        )
    for f in FRACTIONS:
        a, b = by.get(("chat", f, policy)), by.get(("chat", f, "lru"))
        if a is None or b is None:
            continue
        ok = a["hit_tokens"] >= b["hit_tokens"]
        ratio = a["hit_tokens"] / b["hit_tokens"] if b["hit_tokens"] else float("inf")
        out.append(
            f"{'PASS' if ok else 'FAIL'} chat at {f * 100:.0f}%: {policy} {a['hit_tokens']} hit tokens vs lru {b['hit_tokens']} "
            f"({ratio:.2f}x)"
        )
    return out


def table(points: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | tier / working set | policy | hit rate (all) | warm hit rate | hit tokens | evictions |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p['workload']} | {p['fraction'] * 100:.0f}% | {p['policy']} | {p['hit_rate'] * 100:.1f}% | "
            f"{p['warm_hit_rate'] * 100:.1f}% | {p['hit_tokens']} | {p['evictions']} |"
        )
    return "\n".join(lines)


TRACE_SIZES = (0.05, 0.10, 0.25, 0.50)
SHARED_TRACES = HERE.parents[1] / "shared" / "traces"


def trace_points(path: Path, policies: list[str], quick: bool) -> tuple[str, int, list[dict[str, Any]]]:
    """Each policy and the optimum at TRACE_SIZES of ``path``'s distinct blocks."""
    from lmcache_core import replay
    from lmcache_core.traces import load_trace

    trace = load_trace(path, limit=3000 if quick else None)
    keys, nxt = replay.chain_keys(trace), replay.next_uses(trace)
    points = []
    for share in TRACE_SIZES:
        blocks = max(1, int(trace.distinct_blocks * share))
        opt = replay.optimum_hits(trace, blocks, nxt)
        for p in policies:
            r = replay.replay_engine(trace, keys, replay.cpu_config(trace, blocks, p, 512))
            points.append({"share": share, "policy": p, "hits": r.hits, "blocks": r.blocks, "optimum": opt})
    return path.name, trace.blocks, points


def trace_report(
    name: str, points: list[dict[str, Any]], policies: list[str], default: str, quick: bool = False
) -> tuple[str, list[str]]:
    lines = [
        f"\n{name}: block hit ratio; in brackets {default}'s hits over each policy's, and each policy's share of the optimum",
        "| size | " + " | ".join(policies) + " | optimum |",
        "|---|" + "---|" * (len(policies) + 1),
    ]
    bars = []
    for share in TRACE_SIZES:
        row = {p["policy"]: p for p in points if p["share"] == share}
        d = row[default]["hits"]
        cells = []
        for pol in policies:
            r = row[pol]
            ratio = d / r["hits"] if r["hits"] else float("inf")
            cells.append(f"{r['hits'] / r['blocks']:.3f} ({ratio:.2f}x, {r['hits'] / r['optimum']:.2f} opt)")
        opt = row[default]["optimum"] / row[default]["blocks"]
        lines.append(f"| {share * 100:.0f}% | " + " | ".join(cells) + f" | {opt:.3f} |")
        others = [pol for pol in policies if pol != default]
        best = max(others, key=lambda pol: row[pol]["hits"]) if others else default
        ok = all(d >= row[pol]["hits"] for pol in others)
        bars.append(
            f"{'PASS' if ok else 'MISS (quick)' if quick else 'FAIL'} {name} at {share * 100:.0f}%: {default} "
            f"{d / row[best]['hits']:.3f}x the hits of "
            f"the best other ({best})"
        )
        if name.startswith("conversation") and share == 0.10:
            g = d / row[default]["optimum"]
            bars.append(f"{'GOAL' if g >= 0.9 else 'BELOW GOAL'} {name} at 10%: {default} {g:.3f} of the optimum (goal 0.9)")
    return "\n".join(lines), bars


COST_BAR_US = 2.0


def policy_cost(policies: list[str], n: int, rounds: int = 3) -> dict[str, float]:
    """Microseconds per policy call at ``n`` resident chunks, in the order a CPU tier
    makes them: per request a chain hint, then per chunk a hit (resident) or a miss,
    the victims' pops and an insert (admitted or not). Requests of 8 chunks: half
    repeat an earlier prompt's first 4 chunks then go their own way, half are new.
    The same request stream for every policy, rounds interleaved, the fastest kept."""
    import random
    import time

    from lmcache_core.eviction import BUILTIN_POLICIES
    from lmcache_core.keys import KeyNamespace

    ns = KeyNamespace(model="bench-eviction-cost")
    size, per = 256, 8
    rng = random.Random(7)
    fresh = iter(range(1 << 40))
    prompts = [[ns.key(next(fresh).to_bytes(16, "little")) for _ in range(per)] for _ in range(n // per)]
    stream = []
    for _ in range(n // per):
        if rng.random() < 0.5:
            head = prompts[int(len(prompts) * rng.random() ** 2)][:4]  # recent prompts more often
            stream.append(head + [ns.key(next(fresh).to_bytes(16, "little")) for _ in range(per - 4)])
        else:
            stream.append([ns.key(next(fresh).to_bytes(16, "little")) for _ in range(per)])
    best = {p: float("inf") for p in policies}
    for _ in range(rounds):
        for name in policies:
            pol = BUILTIN_POLICIES[name][0](n * size)
            resident: set[object] = set()
            for keys in prompts:  # fill: n resident chunks
                pol.chain(keys)
                for k in keys:
                    pol.insert(k, size)
                    resident.add(k)
            calls = 0
            t0 = time.perf_counter()
            for keys in stream:
                pol.chain(keys)
                calls += 1
                for k in keys:
                    if k in resident:
                        pol.hit(k)
                        calls += 1
                        continue
                    pol.miss(k)
                    calls += 1
                    if not pol.admit(k, size):
                        calls += 1
                        continue
                    v = pol.pop_victim()
                    resident.discard(v)
                    pol.insert(k, size)
                    resident.add(k)
                    calls += 3
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def cost_report(cost: dict[str, float], policy: str, n: int) -> tuple[str, list[str]]:
    base = cost.get("lru")
    lines = [f"\npolicy cost at {n:,} resident chunks (us per call, fastest of 3 interleaved rounds):"]
    lines += [f"  {p}: {us:.2f} us" + (f" ({us - base:+.2f} vs lru)" if base is not None else "") for p, us in cost.items()]
    if base is None or policy not in cost:
        return "\n".join(lines), []
    extra = cost[policy] - base
    ok = extra <= COST_BAR_US
    return "\n".join(lines), [
        f"{'PASS' if ok else 'FAIL'} cost: {policy} {extra:+.2f} us per call vs lru at {n:,} chunks (bar <= {COST_BAR_US} us)"
    ]


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the suite's --quick workloads, 3,000 requests of each trace")
    ap.add_argument("--policies", default=None, help="default: every built-in policy")
    ap.add_argument("--bar-policy", default=DEFAULT_EVICTION, help="the policy the bars are checked for (the default)")
    ap.add_argument("--traces", nargs="*", type=Path, default=None, help="Mooncake-format traces (default: ../shared/traces)")
    ap.add_argument("--no-traces", action="store_true", help="the suite's workloads only")
    ap.add_argument("--no-cost", action="store_true", help="skip the per-call cost of each policy")
    args = ap.parse_args(argv)
    if args.policies:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    else:
        from lmcache_core.eviction import BUILTIN_POLICIES

        policies = sorted(BUILTIN_POLICIES)
    if args.bar_policy not in policies:
        policies.append(args.bar_policy)
    seed = os.environ.get("PYTHONHASHSEED", "random")
    print(
        f"hash seed: PYTHONHASHSEED={seed} ({DEFAULT_EVICTION}'s shadows sample keys by Python's hash, so its "
        "figures on traces vary with it; set it to repeat this run)",
        flush=True,
    )
    bars: list[str] = []
    if not args.no_cost:
        # first, before the trace replays: after them, in the same process, adaptive's
        # calls measured 15-35% slower (+2.03 to +2.82 us against +1.70 run first,
        # 2026-11-29), a figure that then depended on what ran before it
        n = 100_000  # where the bar is set, in --quick too (about 20 s)
        text, cbars = cost_report(policy_cost(policies if "lru" in policies else ["lru", *policies], n), args.bar_policy, n)
        print(text, flush=True)
        bars += cbars
    traces = [] if args.no_traces else (args.traces if args.traces is not None else sorted(SHARED_TRACES.glob("*.jsonl")))
    if not traces and not args.no_traces:
        print(f"no traces found in {SHARED_TRACES} (give --traces FILE ..., or --no-traces)")
    for path in traces:
        name, _, points = trace_points(path, policies, args.quick)
        text, tbars = trace_report(name, points, policies, args.bar_policy, args.quick)
        print(text, flush=True)
        bars += tbars
    points = sweep(args.quick, policies)
    print("\nthe suite's workloads (bench/suite/run.py):")
    print(table(points))
    print()
    bars += check_bars(points, args.bar_policy)
    print("\n".join(bars))
    return 0 if not any(b.startswith("FAIL") for b in bars) else 1


if __name__ == "__main__":
    if "PYTHONHASHSEED" not in os.environ:
        # a seed of its own, printed, so that a run (a missed bar included) can be repeated
        os.environ["PYTHONHASHSEED"] = str(random.SystemRandom().randrange(1, 2**32))
        os.execv(sys.executable, [sys.executable, *sys.argv])
    raise SystemExit(main())
