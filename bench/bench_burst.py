"""A burst of returning users on real vLLM (CPU), side by side in one run (issue #20).

Model: 6 layers, 4 KV heads of 64, float32: 12 KiB of KV per token. 8 users, each
with a 2k-token context (sent once, cold), then each asks new questions (context +
32 new tokens). Three engines stay up together and take turns, so load from other
jobs hits all of them alike:

* ``lmc``: lmcache-core's CPU tier, vLLM's own KV cache at 1/3 of the working set
  (vLLM's prefix caching on);
* ``ref``: vLLM alone, its KV cache big enough to hold everything (the bar);
* ``same``: vLLM alone holding everything like ``ref``, but running at most as many
  requests at once as fit in ``lmc``'s cache (``max_num_seqs``: 2 of the 8 at 1/3), so
  a burst takes as many forward steps as on ``lmc``: the scheduling floor that no
  connector removes at that ratio;
* ``small``: vLLM alone at 1/3 (what the connector saves us from).

``--ratio`` sets vLLM's cache for ``lmc``/``small`` as a fraction of the working set
(default 1/3).

Printed: single-request warm TTFT (one user's next question at a time, median) and
burst time (all users' next questions submitted at once, wall time until every first
token, median over rounds) for each, the ratios lmc/ref and lmc/same; greedy tokens of the last
burst (8 tokens each) compared across the three engines; the no-reuse overhead
(bursts of all-unique prompts on ``lmc`` saving them vs the same process told not
to save, ``lmcache.skip_save``, plus the share of the connector's hooks in such a
burst; next to it lmc vs ``small`` and ``small2`` vs ``small``, two identical vLLM
engines, whose ratio shows how far apart two processes of the same engine run: the
spread every cross-process ratio here carries); and a profile of one extra burst on
``lmc`` (time inside the connector's hooks, by part). Bars: burst <= 1.1x ref,
single <= 1.0x ref, identical tokens, no-reuse overhead <= 5%.

    python bench/bench_burst.py [--quick] [--rounds N] [--repeat K] [--ratio R] [--variant k=v,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

from lib.vllm_engine import close, engine  # noqa: E402  (sets vLLM's env defaults first)

from lmcache_connector.dev.tiny_model import TinyModelSpec, build_tiny_model, random_prompt

SPEC = TinyModelSpec(
    hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096
)
KV_PER_TOKEN = SPEC.num_layers * 2 * SPEC.num_kv_heads * SPEC.head_dim * 4  # float32
BLOCK = 128
QUESTION = 32


Result = tuple[float, list[list[int]], list[int], float]


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 1, params: dict[str, Any] | None = None) -> Result:
    """Submit ``prompts`` at once (with ``params`` as their ``kv_transfer_params``);
    (wall seconds, greedy tokens, cached tokens, CPU seconds of this process). CPU
    time is what the engine itself spent, all threads: on a machine shared with other
    jobs it swings less than wall time (time spent waiting for a core is not counted;
    spinning OpenMP threads are)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": params} if params else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra)
    c, t = time.process_time(), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    return dt, [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs], cpu


# ---------------------------------------------------------------------------- profile


class Profile:
    """Wall time inside named functions while active (``time.perf_counter``), by
    wrapping them on their classes/modules: in-process vLLM only. Calls nested in
    another profiled call are counted in both (the table says which contain which)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        orig = getattr(owner, attr)
        prof = self

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                prof.seconds[label] += time.perf_counter() - t
                prof.calls[label] += 1

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, orig))

    @contextlib.contextmanager
    def active(self) -> Iterator["Profile"]:
        import lmcache_connector.scheduler as sched_mod
        import lmcache_connector.worker as worker_mod
        from lmcache_connector.features.hits import HitPlanner
        from lmcache_connector.layouts.kv_adapters import BlockLayout
        from lmcache_connector.protocol.lookup_ipc import LookupClient
        from lmcache_core.engine import CacheEngine
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        for owner, attr, label in (
            (Scheduler, "schedule", "vLLM scheduler.schedule (calls = steps)"),
            (GPUModelRunner, "execute_model", "vLLM model runner execute_model"),
            (sched_mod.SchedulerSide, "get_num_new_matched_tokens", "  sched: get_num_new_matched_tokens"),
            (LookupClient, "lookup", "    lookup round trip (IPC)"),
            (HitPlanner, "lookup", "      worker: engine lookup (server thread)"),
            (sched_mod, "chunk_hashes", "    hashing (chunk_hashes)"),
            (sched_mod.SchedulerSide, "update_state_after_alloc", "  sched: update_state_after_alloc"),
            (sched_mod.DenseScheduler, "build_connector_meta", "  sched: build_connector_meta"),
            (sched_mod.SchedulerSide, "request_finished", "  sched: request_finished"),
            (worker_mod.WorkerSide, "start_load_kv", "  worker: start_load_kv (loads)"),
            (CacheEngine, "retrieve_buffer", "    tier reads (retrieve_buffer)"),
            (BlockLayout, "load_chunk", "    copies into vLLM blocks"),
            (worker_mod.WorkerSide, "wait_for_save", "  worker: wait_for_save (saves)"),
            (BlockLayout, "save_chunk", "    gathers out of vLLM blocks"),
            (CacheEngine, "store_hashes", "    stores into the CPU tier"),
        ):
            if hasattr(owner, attr):
                self.wrap(owner, attr, label)
        try:
            yield self
        finally:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()

    def hooks(self) -> float:
        """Seconds inside the connector's own hooks (the top-level ``sched:`` and
        ``worker:`` rows; what they contain is inside them)."""
        return sum(v for k, v in self.seconds.items() if k.startswith(("  sched:", "  worker:")))

    def table(self, wall: float) -> str:
        lines = [f"{'part':<48}{'ms':>9}{'calls':>8}{'% of burst':>12}"]
        for label in self.seconds:
            s = self.seconds[label]
            lines.append(f"{label:<48}{s * 1000:>9.1f}{self.calls[label]:>8}{100 * s / wall:>11.1f}%")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- engines


def _serve(conn: Any, model: Path, tmp: Path, max_len: int, spec: dict[str, Any]) -> None:
    """Child process: one engine, answering ``(op, prompts, max_tokens, params)`` messages."""
    spec = dict(spec)
    llm = engine(model, spec.pop("system"), tmp, max_len, **spec)
    conn.send("ready")
    try:
        while True:
            op, prompts, max_tokens, params = conn.recv()
            if op == "close":
                break
            if op == "profile":
                with Profile().active() as prof:
                    dt = generate(llm, prompts)[0]
                conn.send((prof.table(dt), dt, prof.hooks()))
            else:
                conn.send(generate(llm, prompts, max_tokens, params))
    finally:
        close(llm)
        conn.send("closed")


class Remote:
    """An engine in its own process (spawned), driven in lock-step from here."""

    def __init__(self, name: str, model: Path, tmp: Path, max_len: int, spec: dict[str, Any]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, model, tmp, max_len, spec), name=f"bench-{name}", daemon=True)
        self.proc.start()

    def ready(self) -> None:
        if self.conn.recv() != "ready":
            raise RuntimeError(f"engine {self.name} did not start")

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, params: dict[str, Any] | None = None) -> Result:
        self.conn.send(("generate", prompts, max_tokens, params))
        return self.conn.recv()

    def profile(self, prompts: list[list[int]]) -> tuple[str, float, float]:
        self.conn.send(("profile", prompts, 1, None))
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", None, 0, None))
                self.conn.recv()
            except (EOFError, OSError):
                pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------------- workload


def question(user: int, rnd: int) -> list[int]:
    return random_prompt(QUESTION, 50_000 + 1000 * rnd + user, SPEC.vocab_size)


def parse_options(text: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``key=value,...`` over ``base``; a dotted key (``connector.async_saves=true``)
    sets one key of a section, keeping the section's other keys."""
    out: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in (base or {}).items()}
    for kv in filter(None, text.split(",")):
        k, v = kv.split("=", 1)
        value = int(v) if v.isdigit() else {"true": True, "false": False}.get(v, v)
        section, dot, key = k.partition(".")
        if dot:
            out.setdefault(section, {})[key] = value
        else:
            out[k] = value
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 users x 1k tokens, 1 burst round (smoke test)")
    ap.add_argument("--rounds", type=int, default=None, help="timed burst rounds (default 5, --quick 1)")
    ap.add_argument("--extra", default="", help="connector options for lmc, key=value,... (e.g. chunk_size=512)")
    ap.add_argument(
        "--variant", default="", help="add engine lmc2: lmc with these options on top (e.g. connector.async_saves=true)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="run everything this many times on fresh engine processes")
    ap.add_argument(
        "--ratio", type=float, default=1 / 3, help="vLLM's own KV cache for lmc and small, as a fraction of the working set"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the medians and paired ratios here")
    args = ap.parse_args()
    users, ctx_tokens = (4, 1024) if args.quick else (8, 2048)
    rounds = args.rounds or (1 if args.quick else 5)
    nr_tokens, nr_rounds = (512, 2) if args.quick else (1024, 6)
    extra = parse_options(args.extra)

    tmp = Path(tempfile.mkdtemp(prefix="lmcache-burst-"))
    model = build_tiny_model(Path.home() / ".cache" / "lmcache-core" / SPEC.tag(), SPEC)
    max_len = ctx_tokens + QUESTION + 16
    working_set = users * ctx_tokens * KV_PER_TOKEN
    blocks_per_req = -(-(ctx_tokens + QUESTION) // BLOCK)
    small_bytes = int(working_set * args.ratio)
    block_bytes = BLOCK * KV_PER_TOKEN
    # Requests that fit in vLLM's cache at once at that ratio (vLLM keeps one null
    # block out of the pool): what ``same`` is limited to.
    fit = max(1, min(users, (small_bytes // block_bytes - 1) // blocks_per_req))
    # The reference holds every context plus the questions' blocks, with room to spare.
    ref_bytes = 2 * users * blocks_per_req * BLOCK * KV_PER_TOKEN
    contexts = [random_prompt(ctx_tokens, 1000 + u, SPEC.vocab_size) for u in range(users)]
    print(
        f"model {SPEC.tag()} ({KV_PER_TOKEN // 1024} KiB KV/token); {users} users x {ctx_tokens} tokens "
        f"= {working_set / 2**20:.0f} MiB working set; vLLM KV cache: {small_bytes / 2**20:.0f} MiB "
        f"(ratio {args.ratio:.3f}, {small_bytes // block_bytes} blocks of {BLOCK}: {fit} requests at once) for lmc and "
        f"small, {ref_bytes / 2**20:.0f} MiB for ref and same (same: max_num_seqs={fit})",
        flush=True,
    )

    names: tuple[str, ...] = ("lmc", "ref", "same", "small")
    specs = {
        "lmc": dict(system="lmcache", kv_bytes=small_bytes, prefix_caching=True, extra=extra),
        "ref": dict(system="vllm-prefix-cache", kv_bytes=ref_bytes),
        "same": dict(system="vllm-prefix-cache", kv_bytes=ref_bytes, max_num_seqs=fit),
        "small": dict(system="vllm-prefix-cache", kv_bytes=small_bytes),
    }
    lmcs = ["lmc"]
    if args.variant:
        specs["lmc2"] = dict(specs["lmc"], extra=parse_options(args.variant, extra))
        names, lmcs = ("lmc", "lmc2", "ref", "same", "small"), ["lmc", "lmc2"]
        print(f"lmc2 = lmc with {specs['lmc2']['extra']}", flush=True)
    # One process per engine (vLLM keeps its connector in a process-wide global, so
    # engines with and without one cannot share a process); they take turns.
    # small2: a second engine identical to small, in the no-reuse runs only: the spread
    # between two processes of the same engine, which every cross-process ratio carries.
    specs["small2"] = specs["small"]
    single: dict[str, list[float]] = defaultdict(list)
    cpu: dict[tuple[str, str], list[float]] = defaultdict(list)  # (workload, engine)
    cached_single: dict[str, list[int]] = defaultdict(list)
    burst: dict[str, list[float]] = defaultdict(list)
    cached_burst: dict[str, list[int]] = defaultdict(list)
    nr: dict[str, list[float]] = defaultdict(list)
    profiles: dict[str, tuple[str, float, float]] = {}  # the last repeat's
    identical = True
    # --repeat K: the whole run K times, each on fresh processes (ratios pooled over
    # all rounds of all repeats), as two processes of the same engine can run a few
    # percent (up to ~15% seen here) apart for their whole life.
    for rep in range(args.repeat):
        llms: dict[str, Remote] = {}
        try:
            if args.repeat > 1:
                print(f"repeat {rep + 1} of {args.repeat}: fresh engine processes", flush=True)
            for name in (*names, "small2"):
                llms[name] = Remote(name, model, tmp, max_len, specs[name])
            for name in (*names, "small2"):
                llms[name].ready()
                llms[name].generate([random_prompt(64, 7, SPEC.vocab_size)])  # warm-up

            print("history: each user's context once, cold ...", flush=True)
            for u in range(users):
                for name in names:
                    llms[name].generate([contexts[u]])

            for u in range(users):
                for name in names:
                    dt, _, cached, c = llms[name].generate([contexts[u] + question(u, 0)])
                    single[name].append(dt)
                    cpu["single", name].append(c)
                    cached_single[name] += cached

            for r in range(1, rounds + 1):
                order = names if r % 2 else tuple(reversed(names))
                for name in order:
                    dt, _, cached, c = llms[name].generate([contexts[u] + question(u, r) for u in range(users)])
                    burst[name].append(dt)
                    cpu["burst", name].append(c)
                    cached_burst[name] += cached

            # Greedy identity: 8 tokens per user, all at once, on every engine.
            final = [contexts[u] + question(u, rounds + 1) for u in range(users)]
            tokens = {name: llms[name].generate(final, max_tokens=8)[1] for name in names}
            identical = identical and all(tokens[n] == tokens["ref"] for n in names)

            # Profile one more burst and one more single request on lmc and ref.
            prof_prompts = [contexts[u] + question(u, rounds + 2) for u in range(users)]
            for name in (*lmcs, "ref", "same"):
                profiles[f"burst on {name}"] = llms[name].profile(prof_prompts)
            for name in (*lmcs, "ref"):
                profiles[f"single request on {name}"] = llms[name].profile([contexts[0] + question(0, rounds + 3)])

            # No-reuse: bursts of unique prompts on each lmc engine saving them, on the same
            # process told not to (lmcache.skip_save: the same process, so free of the
            # spread between processes), on small (vLLM alone at the same ratio) and on
            # small2; the order rotates every round.
            arms: list[tuple[str, str, dict[str, Any] | None]] = [(n, n, None) for n in lmcs]
            arms += [(f"{n} skip_save", n, {"lmcache.skip_save": True}) for n in lmcs]
            arms += [("small", "small", None), ("small2", "small2", None)]
            seed = 900_000 + 100_000 * rep
            for r in range(nr_rounds):
                for label, name, params in arms[r % len(arms) :] + arms[: r % len(arms)]:
                    prompts = []
                    for _ in range(users):
                        seed += 1
                        prompts.append(random_prompt(nr_tokens, seed, SPEC.vocab_size))
                    dt, _, cached, c = llms[name].generate(prompts, params=params)
                    assert not any(cached), f"no-reuse prompts must not hit ({label}: {cached})"
                    nr[label].append(dt)
                    cpu["no-reuse", label].append(c)
            prompts = [random_prompt(nr_tokens, seed + 1 + u, SPEC.vocab_size) for u in range(users)]
            for name in lmcs:
                profiles[f"no-reuse burst on {name}"] = llms[name].profile(prompts)
        finally:
            for llm in llms.values():
                llm.close()

    med = {k: statistics.median(v) for k, v in single.items()}
    bmed = {k: statistics.median(v) for k, v in burst.items()}
    print(
        f"\n{'engine':<8}{'single warm TTFT ms':>21}{'cached tok':>12}{'burst ms':>11}{'cached tok/burst':>18}{'burst rounds ms':>40}"
    )
    for name in names:
        rounds_ms = " ".join(f"{x * 1000:.0f}" for x in burst[name])
        print(
            f"{name:<8}{med[name] * 1000:>21.1f}{statistics.median(cached_single[name]):>12.0f}"
            f"{bmed[name] * 1000:>11.1f}{sum(cached_burst[name]) / len(burst[name]):>18.0f}{rounds_ms:>40}"
        )
    # Bars on the median of paired ratios: each round's engines ran back to back, so
    # a slow spell of the machine (other jobs) lands on both sides of a pair.
    for name in lmcs:
        pairs = [a / b for a, b in zip(burst[name], burst["ref"])]
        spairs = [a / b for a, b in zip(single[name], single["ref"])]
        s_ratio, b_ratio = statistics.median(spairs), statistics.median(pairs)
        print(
            f"\n{name}: single request vs ref {s_ratio:.2f}x, median of per-user ratios (bar <= 1.0x: "
            f"{'met' if s_ratio <= 1.0 else 'NOT met'}); ratio of medians {med[name] / med['ref']:.2f}x"
        )
        print(
            f"{name}: burst vs ref {b_ratio:.2f}x, median of per-round ratios {' '.join(f'{p:.2f}' for p in pairs)} "
            f"(bar <= 1.1x: {'met' if b_ratio <= 1.1 else 'NOT met'}); ratio of medians {bmed[name] / bmed['ref']:.2f}x"
        )
        # Against the engine that holds everything but runs the burst in as many
        # steps as lmc: what is left is the connector's own cost.
        same_pairs = [a / b for a, b in zip(burst[name], burst["same"])]
        ssame = [a / b for a, b in zip(single[name], single["same"])]
        print(
            f"{name}: burst vs same {statistics.median(same_pairs):.2f}x, median of per-round ratios "
            f"{' '.join(f'{p:.2f}' for p in same_pairs)}; single vs same {statistics.median(ssame):.2f}x; "
            f"ratio of medians {bmed[name] / bmed['same']:.2f}x"
        )
        # The bar's ratio: this engine saving every chunk vs the same process saving
        # nothing; what the connector costs beyond its saves is its hooks' time.
        own = statistics.median(a / b for a, b in zip(nr[name], nr[f"{name} skip_save"]))
        _, wall, hooks = profiles[f"no-reuse burst on {name}"]
        print(
            f"{name}: no-reuse bursts ({users} unique x {nr_tokens} tokens, {nr_rounds} rounds), saving vs the same "
            f"engine not saving (lmcache.skip_save): {own:.3f}, median of per-round ratios; the connector's hooks "
            f"take {100 * hooks / wall:.1f}% of one such burst (saves included); overhead bar <= 1.05: "
            f"{'met' if own <= 1.05 and hooks / wall <= 0.05 else 'NOT met'}"
        )
        vs_small = statistics.median(a / b for a, b in zip(nr[name], nr["small"]))
        spread = statistics.median(a / b for a, b in zip(nr["small2"], nr["small"]))
        print(
            f"{name}: no-reuse vs vLLM alone (small, another process) {vs_small:.3f}; small2 vs small, two identical "
            f"vLLM engines, {spread:.3f}: the spread between processes in every cross-process ratio here; medians "
            + ", ".join(f"{k} {statistics.median(v) * 1000:.0f} ms" for k, v in nr.items())
        )
    print("\nCPU seconds of the engine process (all its threads), median of paired ratios:")
    for name in lmcs:
        row = []
        for work, base, against in (
            ("single", name, "ref"),
            ("burst", name, "ref"),
            ("burst", name, "same"),
            ("no-reuse", name, f"{name} skip_save"),
            ("no-reuse", name, "small"),
            ("no-reuse", "small2", "small"),
        ):
            ratios = [a / b for a, b in zip(cpu[work, base], cpu[work, against]) if b > 0]
            row.append(f"{work} {base} vs {against} {statistics.median(ratios):.2f}x")
        print(f"  {name}: {', '.join(row)}")
    print(
        f"vLLM alone at the ratio (small) vs ref: single {med['small'] / med['ref']:.2f}x, burst {bmed['small'] / bmed['ref']:.2f}x"
    )
    floor = statistics.median(a / b for a, b in zip(burst["same"], burst["ref"]))
    print(
        f"same (ref limited to {fit} requests at once) vs ref: burst {floor:.2f}x, median of per-round ratios: "
        f"the scheduling floor at this ratio"
    )
    if args.json is not None:
        summary: dict[str, Any] = {
            "seconds": {f"{n} single warm TTFT": med[n] for n in names} | {f"{n} burst": bmed[n] for n in names},
            "ratios": {},
            "identical": identical,
        }
        for name in lmcs:  # paired ratios: machine-wide slow spells cancel
            summary["ratios"][f"{name} single vs ref"] = statistics.median(a / b for a, b in zip(single[name], single["ref"]))
            summary["ratios"][f"{name} burst vs ref"] = statistics.median(a / b for a, b in zip(burst[name], burst["ref"]))
            summary["ratios"][f"{name} no-reuse saving vs not"] = statistics.median(
                a / b for a, b in zip(nr[name], nr[f"{name} skip_save"])
            )
        args.json.write_text(json.dumps(summary, indent=1))
    print(f"greedy tokens (8 per user, {users} users at once) identical across {', '.join(names)}: {identical}")
    if not identical:
        for name in names:
            print(f"  {name}: {tokens[name]}")
    for name, (table, dt, _) in profiles.items():
        print(f"\nprofile of one {name}: {dt * 1000:.1f} ms wall")
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
