"""What the ``fp8`` codec does to a model's output, per model family, on real vLLM (CPU).

    python bench/bench_fp8_fidelity.py [--families llama gemma3 ...] [--tokens 64] [--prompts 3] [--json PATH]

For each family (the project's dense demo model and the small models of
:mod:`lmcache_connector.dev.tiny_hybrid`), two fresh engines, each with one tier: a
disk tier whose codec is ``raw`` in one and ``fp8`` in the other. Each prompt is
generated twice, greedily, ``--tokens`` tokens: first computed (nothing stored
yet; its KV is then saved), then again with its prefix loaded from the tier.
Per family:

- **hit**: tokens the second request loaded;
- **K / V error**: relative error (Frobenius norm of the error over the norm) of the
  stored chunks after an fp8 round trip, K and V apart where the chunk has a k/v
  axis (dense and sliding-window layouts), else over the whole chunk (MLA's latent,
  hybrid groups);
- **greedy agreement**: the share of the ``--tokens`` tokens equal to the computed
  run's, position by position, and the first position that differs;
- **max |d log p|**: the largest difference of the first generated token's log
  probabilities (its top 20 in both runs) between loaded and computed.

The ``raw`` rows are the control: a lossless copy must agree 100% with 0 difference
(with MLA too, whose prompt leaves one token after the hit so both runs split the
prefill alike). Targets (issue #35): K and V error <= 3%; agreement >= 95% on the
dense model. Never part of the test pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from lib.ttft_engine import run_child, run_if_child  # noqa: E402

CACHE = Path.home() / ".cache" / "lmcache-core"
TOP = 20

# prompt length, the engine's settings: what tests/connector/test_e2e_hybrid.py uses
# to get hits for each family (state-space models keep states only where a step ends)
FAMILIES: dict[str, tuple[int, dict[str, Any]]] = {
    "llama": (1500, {}),
    "gemma3": (1500, {}),
    "gpt_oss": (1500, {"dtype": "bfloat16"}),
    "mistral_sw": (1500, {}),
    "deepseek_v2": (1281, {"max_num_batched_tokens": 1280}),
    "granite_hybrid": (1500, {"max_num_batched_tokens": 512}),
    "qwen3_next": (1537, {"dtype": "bfloat16", "max_num_batched_tokens": 768}),
}


def build(family: str) -> Path:
    if family == "llama":
        from lmcache_connector.dev.tiny_model import DEMO_SPEC, build_tiny_model

        return build_tiny_model(CACHE / DEMO_SPEC.tag(), DEMO_SPEC)
    from lmcache_connector.dev.tiny_hybrid import build_hybrid_model

    return build_hybrid_model(CACHE / f"hybrid-{family}", family)


def chunk_errors(disk: str, kv_axis: bool) -> dict[str, Any]:
    """Relative error of an fp8 round trip of every chunk stored (raw) under ``disk``;
    K and V apart when the chunk's axis 1 is k/v (``kv_axis``: dense attention; MLA's
    chunk is ``[layers, blocks, 1, block_size, latent]``)."""

    from lmcache_core.fp8 import Fp8Codec
    from lmcache_core.serde import FrameError, RawCodec, decode

    fp8, codecs = Fp8Codec(), {"raw": RawCodec()}
    err: dict[str, list[float]] = {}
    shape: list[int] = []
    for f in sorted(Path(disk).rglob("*")):
        if not f.is_file():
            continue
        try:
            t = decode(f.read_bytes(), codecs)
        except FrameError:
            continue  # the tier's own files (marker, usage)
        if not t.dtype.is_floating_point or t.numel() == 0:
            continue
        shape = list(t.shape)
        back = fp8.decode_tensor(fp8.encode_tensor(t), t.dtype, tuple(t.shape), None)
        parts = (
            {"K": (t[:, 0], back[:, 0]), "V": (t[:, 1], back[:, 1])}
            if kv_axis and t.dim() == 5 and t.shape[1] == 2
            else {"all": (t, back)}
        )
        for name, (a, b) in parts.items():
            norm = float(a.float().norm())
            if norm > 0:
                err.setdefault(name, []).append(float((b.float() - a.float()).norm()) / norm)
    return {name: max(v) for name, v in err.items()} | {"chunks": float(len(next(iter(err.values()), []))), "shape": shape}


def frame_codecs(disk: str) -> dict[str, int]:
    """Frames under ``disk`` by the codec their header names (an fp8 tier frames the
    byte pages of grouped layouts raw)."""
    from lmcache_core.serde import FrameError, parse_header

    n: dict[str, int] = {}
    for f in Path(disk).rglob("*"):
        if f.is_file():
            try:
                codec = parse_header(f.read_bytes())[1]["codec"]
            except (FrameError, KeyError):
                continue
            n[codec] = n.get(codec, 0) + 1
    return n


def child(
    model: str, llm_kw: dict[str, Any], prompts: list[list[int]], tokens: int, codec: str, disk: str, kv_axis: bool
) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from lmcache_connector.transfer_config import kv_transfer_config

    tier = {"name": "disk", "path": disk, "max_size": "4GiB", "fsync": False, "serde": codec}
    llm = LLM(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
        max_model_len=4096,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config=kv_transfer_config({"chunk_size": 256, "backends": [tier]}),
        **llm_kw,
    )
    sp = SamplingParams(max_tokens=tokens, temperature=0, logprobs=TOP, ignore_eos=True)
    engine = get_kv_transfer_group().worker.engine

    def gen(p: list[int]) -> tuple[list[int], dict[int, float], int]:
        (r,) = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        o = r.outputs[0]
        return list(o.token_ids), {int(t): float(lp.logprob) for t, lp in o.logprobs[0].items()}, int(r.num_cached_tokens or 0)

    out = []
    for p in prompts:
        computed, lp_c, _ = gen(p)
        engine.flush(300)
        loaded, lp_l, hit = gen(p)
        out.append({"computed": computed, "loaded": loaded, "lp_computed": lp_c, "lp_loaded": lp_l, "hit": hit})
    errors = chunk_errors(disk, kv_axis) if codec == "raw" else {}
    print("RESULT " + json.dumps({"prompts": out, "errors": errors, "frames": frame_codecs(disk)}), flush=True)
    llm.llm_engine.engine_core.shutdown()


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return same / max(1, len(a)), first


def max_dlogp(a: dict[str, float], b: dict[str, float]) -> float:
    common = set(a) & set(b)
    return max((abs(a[t] - b[t]) for t in common), default=float("nan"))


def measure(family: str, n_prompts: int, tokens: int) -> dict[str, Any]:
    from lmcache_connector.dev.tiny_hybrid import random_prompt

    length, llm_kw = FAMILIES[family]
    model = build(family)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [random_prompt(length, 7000 + i, vocab) for i in range(n_prompts)]
    rows: dict[str, Any] = {}
    for codec in ("raw", "fp8"):
        with tempfile.TemporaryDirectory(prefix=f"fp8-fidelity-{family}-") as d:
            job = {
                "model": str(model),
                "llm_kw": llm_kw,
                "prompts": prompts,
                "tokens": tokens,
                "codec": codec,
                "disk": d,
                "kv_axis": family != "deepseek_v2",  # MLA: one latent, no k/v axis
            }
            r = run_child(__file__, job, f"{family} ({codec})")
        per = [
            (agreement(p["computed"], p["loaded"]), max_dlogp(p["lp_computed"], p["lp_loaded"]), p["hit"]) for p in r["prompts"]
        ]
        rows[codec] = {
            "hit": min(h for _, _, h in per),
            "agreement": statistics.mean(a for (a, _), _, _ in per),
            "first_difference": [f for (_, f), _, _ in per],
            "max_dlogp": max(d for _, d, _ in per),
        }
        rows[codec]["frames"] = r["frames"]
        if codec == "raw":
            rows["errors"] = r["errors"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="one prompt of 16 tokens per family")
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.tokens = 1, 16
    print(f"bench_fp8_fidelity: {a.prompts} prompts per family, {a.tokens} greedy tokens each, disk tier raw vs fp8", flush=True)
    print(
        "| family | hit tokens raw / fp8 | frames of the fp8 tier | K / V error (max over chunks) "
        "| greedy agreement raw / fp8 | first difference (fp8) | max abs d log p raw / fp8 |"
    )
    print("|---|---|---|---|---|---|---|")
    results: dict[str, Any] = {}
    for family in a.families:
        try:
            r = measure(family, a.prompts, a.tokens)
        except Exception as err:  # one family's failure is reported, the others still run
            print(f"| {family} | failed: {type(err).__name__}: {str(err)[-300:]!r} | | | | | |", flush=True)
            continue
        results[family] = r
        e, raw, fp8 = r["errors"], r["raw"], r["fp8"]
        frames = ", ".join(f"{n} {c}" for c, n in sorted(fp8["frames"].items())) or "none"
        if "fp8" not in fp8["frames"]:
            err_text = "n/a (byte pages, stored raw)"
        elif "K" in e:
            err_text = f"{e['K']:.2%} / {e['V']:.2%}"
        else:
            err_text = f"{e['all']:.2%} (whole chunk)" if "all" in e else "n/a"
        print(
            f"| {family} | {raw['hit']} / {fp8['hit']} | {frames} | {err_text} | {raw['agreement']:.1%} / {fp8['agreement']:.1%} | "
            f"{fp8['first_difference']} | {raw['max_dlogp']:.4f} / {fp8['max_dlogp']:.4f} |",
            flush=True,
        )
    if a.json is not None:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if not run_if_child(child):
        main()
