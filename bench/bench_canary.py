"""Correctness canary on real vLLM (CPU): what sampling costs, and whether the
recomputation of a stored prefix is bit-exact (which decides the tolerance).

1. TTFT overhead, side by side in one engine (the bench_connector model and
   documents, CPU tier, ``verify_fraction: 0.01``): warm requests alternate between
   ``lmcache.verify: false`` (canary off) and no option (sampled at 1%); a third arm
   forces ``lmcache.verify: true`` to price one verified request. Prints the mean
   TTFT ratio of the sampled arm to the off arm, and the overhead expected at 1%
   from the measured cost of one verified request.
2. Determinism: for fp32 and bf16, one engine stores a batch of prompts with
   chunked prefill (512-token steps, several requests per step) into a disk tier;
   a second engine with another step size (4096) recomputes each prompt alone with
   ``lmcache.verify: true``; every comparison is recorded (bit-identical, or the
   relative error).

    python bench/bench_canary.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lib.vllm_engine import SPEC, close  # bench/ is on sys.path when run as a script

from lmcache_connector.dev.tiny_model import TEST_SPEC, build_tiny_model, random_prompt


def _llm(model: Path, extra: dict[str, Any], **kw: Any) -> Any:
    from vllm import LLM
    from lmcache_connector.transfer_config import kv_transfer_config

    args: dict[str, Any] = dict(
        model=str(model),
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config=kv_transfer_config(extra),
    )
    args.update(kw)
    return LLM(**args)


def _ttft(llm: Any, prompt: list[int], params: dict[str, Any] | None) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": params} if params else None)
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return time.perf_counter() - t, out[0].num_cached_tokens


def _worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def overhead(n_docs: int, doc_tokens: int, rounds: int, forced: int) -> None:
    model = build_tiny_model(Path.home() / ".cache" / "lmcache-core" / SPEC.tag(), SPEC)
    docs = [random_prompt(doc_tokens, 100 + i, SPEC.vocab_size) for i in range(n_docs)]
    llm = _llm(
        model, {"verify_fraction": 0.01}, dtype="float32", max_model_len=doc_tokens + 64, max_num_batched_tokens=doc_tokens + 64
    )
    _ttft(llm, random_prompt(64, 7, SPEC.vocab_size), None)
    for d in docs:
        _ttft(llm, d, {"lmcache.verify": False})
    w = _worker()
    arms: dict[str, list[float]] = {"off": [], "sampled 1%": [], "verified": []}
    sampled = 0
    for r in range(rounds):
        for i, d in enumerate(docs):
            order = [("off", {"lmcache.verify": False}), ("sampled 1%", None)]
            for name, params in order if (r + i) % 2 == 0 else order[::-1]:
                v0 = w.totals.verified_chunks
                t, _ = _ttft(llm, d, params)
                arms[name].append(t)
                sampled += name == "sampled 1%" and w.totals.verified_chunks > v0
    for k in range(forced):
        arms["verified"].append(_ttft(llm, docs[k % n_docs], {"lmcache.verify": True})[0])
    mismatches = w.engine.stats()["verify_mismatches"]
    close(llm)
    off, samp, ver = (statistics.mean(arms[k]) for k in ("off", "sampled 1%", "verified"))
    print(f"\n1. TTFT overhead: {n_docs} documents x {doc_tokens} tokens, {rounds * n_docs} warm requests per arm, alternating")
    print(f"{'arm':<14}{'requests':>10}{'mean ms':>10}{'median ms':>11}{'mean/off':>10}")
    for name, ts in arms.items():
        print(
            f"{name:<14}{len(ts):>10}{statistics.mean(ts) * 1000:>10.1f}{statistics.median(ts) * 1000:>11.1f}{statistics.mean(ts) / off:>10.3f}"
        )
    print(f"sampled requests in the 1% arm: {sampled} of {len(arms['sampled 1%'])}; mismatches: {mismatches or 'none'}")
    print(f"measured mean TTFT ratio, 1% sampling / off: {samp / off:.3f}")
    print(f"expected at 1% from one verified request ({ver / off:.1f}x a warm hit): {1 + 0.01 * (ver - off) / off:.3f}")


def determinism(n_prompts: int, tokens: int) -> None:
    import lmcache_connector.transfers.chunks as chunks_mod
    from lmcache_core.canary import compare

    model = build_tiny_model(Path.home() / ".cache" / "lmcache-core" / TEST_SPEC.tag(), TEST_SPEC)
    prompts = [random_prompt(tokens, 300 + i) for i in range(n_prompts)]
    print(
        f"\n2. Determinism: {n_prompts} prompts x {tokens} tokens stored batched in 512-token steps, recomputed alone in one step"
    )
    print(f"{'dtype':<10}{'compared':>10}{'bit-identical':>15}{'max rel err':>13}{'mismatches':>12}")
    for dtype in ("float32", "bfloat16"):
        seen: list[str] = []

        def recording(stored: Any, fresh: Any, vd: Any = None) -> tuple[bool, str]:
            ok, detail = compare(stored, fresh, vd)
            seen.append(detail)
            return ok, detail

        with tempfile.TemporaryDirectory() as tmp:
            tiers = {
                "backends": [{"name": "local_cpu", "max_size": "256MiB"}, {"name": "disk", "path": tmp}],
                "verify_fraction": 0.0,
            }
            llm = _llm(model, tiers, dtype=dtype, max_model_len=tokens + 64, max_num_batched_tokens=512)
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
            assert _worker().engine.flush(60)
            close(llm)
            llm = _llm(model, tiers, dtype=dtype, max_model_len=tokens + 64, max_num_batched_tokens=4096)
            old = chunks_mod.compare
            chunks_mod.compare = recording
            try:
                for p in prompts:
                    _ttft(llm, p, {"lmcache.verify": True})
                mism = _worker().engine.stats()["verify_mismatches"]
            finally:
                chunks_mod.compare = old
                close(llm)
        exact = sum(d == "bit-identical" for d in seen)
        rel = [float(d.split()[2]) for d in seen if d.startswith("relative error")]
        print(f"{dtype:<10}{len(seen):>10}{exact:>15}{(max(rel) if rel else 0.0):>13.2e}{sum(mism.values()) if mism else 0:>12}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        overhead(n_docs=2, doc_tokens=1536, rounds=10, forced=4)
        determinism(n_prompts=3, tokens=1100)
    else:
        overhead(n_docs=4, doc_tokens=3072, rounds=25, forced=8)
        determinism(n_prompts=6, tokens=2100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
