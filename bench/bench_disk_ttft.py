"""Warm TTFT from disk in a fresh process, side by side in one run, same prompts:

* recompute: a fresh vLLM process, no connector (cold prefill)
* ExampleConnector: process A saves its safetensors files; a fresh process B loads them
* lmcache-core disk: process A stores (CPU tier + disk tier); a fresh process B, whose
  CPU tier starts empty, loads from the disk tier

vLLM's prefix caching is off everywhere. With ``--drop-caches`` (root only) the page
cache is dropped before each process B, so "warm" means read from the device.
Target: lmcache-core's warm TTFT from disk below ExampleConnector's.

    python bench/bench_disk_ttft.py [--quick] [--drop-caches]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SPEC_KW = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096)


def ttft(llm: Any, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Time to first token of each prompt, one request at a time, and its cached tokens."""
    import time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0)
    times, cached = [], []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
        cached.append(out[0].num_cached_tokens)
    return times, cached


def child(model: str, system: str, store: str, prompts: list[list[int]]) -> None:
    """One vLLM process: TTFT of each prompt, as a JSON line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from lmcache_connector.transfer_config import kv_transfer_config
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(
        model=model,
        enforce_eager=True,
        dtype="float32",
        max_model_len=8192,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
        seed=0,
    )
    if system == "example":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config={"shared_storage_path": store}
        )
    elif system == "lmcache-disk":
        kw["kv_transfer_config"] = kv_transfer_config(
            {"backends": [{"name": "local_cpu", "max_size": "1GiB"}, {"name": "disk", "path": store, "max_size": "8GiB"}]}
        )
    llm = LLM(**kw)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 32)], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up, no reuse
    times, cached = ttft(llm, prompts)
    if system == "lmcache-disk":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group()._worker.engine.flush(120)
    print("RESULT " + json.dumps({"times": times, "cached": cached}), flush=True)
    llm.llm_engine.engine_core.shutdown()


def run_child(model: Path, system: str, store: Path, prompts: list[list[int]]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(model), system, str(store), f.name],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{system} process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(Path(sys.argv[5]).read_text()))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each reading process (root)")
    args = ap.parse_args()
    from lmcache_connector.tiny_model import TinyModelSpec, build_tiny_model, random_prompt

    spec = TinyModelSpec(**SPEC_KW)
    model = build_tiny_model(Path.home() / ".cache" / "lmcache-core" / spec.tag(), spec)
    n, tokens = (3, 2048) if args.quick else (6, 4096)
    prompts = [random_prompt(tokens, 700 + i, spec.vocab_size) for i in range(n)]
    tmp = Path(tempfile.mkdtemp(prefix="lmcache-disk-ttft-"))
    print(
        f"model {spec.tag()} (float32), {n} prompts x {tokens} tokens; each system: writer process, then a fresh reader process",
        flush=True,
    )
    cold = run_child(model, "recompute", tmp / "none", prompts)
    res: dict[str, dict[str, Any]] = {}
    for system in ("example", "lmcache-disk"):
        store = tmp / system
        store.mkdir()
        print(f"  {system}: writer ...", flush=True)
        run_child(model, system, store, prompts)
        dropped = drop_caches() if args.drop_caches else False
        print(f"  {system}: fresh reader{' (page cache dropped)' if dropped else ''} ...", flush=True)
        res[system] = run_child(model, system, store, prompts)
        res[system]["dropped"] = dropped
    base = statistics.median(cold["times"])
    print(f"\n{'system':<16}{'TTFT ms (median)':>18}{'vs recompute':>14}{'cached tok':>12}  note")
    print(
        f"{'recompute':<16}{base * 1000:>18.1f}{1.0:>14.3f}{int(statistics.median(cold['cached'])):>12}  fresh process, no connector"
    )
    for system, r in res.items():
        med = statistics.median(r["times"])
        note = "fresh process; page cache dropped" if r["dropped"] else "fresh process; files in page cache"
        print(f"{system:<16}{med * 1000:>18.1f}{med / base:>14.3f}{int(statistics.median(r['cached'])):>12}  {note}")
    ratio = statistics.median(res["lmcache-disk"]["times"]) / statistics.median(res["example"]["times"])
    print(f"target: lmcache-core disk warm TTFT < ExampleConnector's -> {ratio:.2f}x ({'met' if ratio < 1 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
