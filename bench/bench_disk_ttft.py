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
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from lib.ttft_engine import finish, make_llm, run_child, run_if_child, tiny_model, ttft  # noqa: E402


def child(model: str, system: str, store: str, prompts: list[list[int]]) -> None:
    """One vLLM process: TTFT of each prompt, as a JSON line."""
    from vllm.config import KVTransferConfig
    from lmcache_connector.transfer_config import kv_transfer_config

    config: Any = None
    if system == "example":
        config = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config={"shared_storage_path": store}
        )
    elif system == "lmcache-disk":
        config = kv_transfer_config(
            {"backends": [{"name": "local_cpu", "max_size": "1GiB"}, {"name": "disk", "path": store, "max_size": "8GiB"}]}
        )
    llm = make_llm(model, config)
    times, cached = ttft(llm, prompts)
    finish(llm, {"times": times, "cached": cached}, flush=system == "lmcache-disk")


def run_system(model: Path, system: str, store: Path, prompts: list[list[int]]) -> dict[str, Any]:
    job = {"model": str(model), "system": system, "store": str(store), "prompts": prompts}
    result: dict[str, Any] = run_child(__file__, job, system)
    return result


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    if run_if_child(child):
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each reading process (root)")
    args = ap.parse_args()
    from lmcache_connector.dev.tiny_model import random_prompt

    spec, model = tiny_model()
    n, tokens = (3, 2048) if args.quick else (6, 4096)
    prompts = [random_prompt(tokens, 700 + i, spec.vocab_size) for i in range(n)]
    tmp = Path(tempfile.mkdtemp(prefix="lmcache-disk-ttft-"))
    print(
        f"model {spec.tag()} (float32), {n} prompts x {tokens} tokens; each system: writer process, then a fresh reader process",
        flush=True,
    )
    cold = run_system(model, "recompute", tmp / "none", prompts)
    res: dict[str, dict[str, Any]] = {}
    for system in ("example", "lmcache-disk"):
        store = tmp / system
        store.mkdir()
        print(f"  {system}: writer ...", flush=True)
        run_system(model, system, store, prompts)
        dropped = drop_caches() if args.drop_caches else False
        print(f"  {system}: fresh reader{' (page cache dropped)' if dropped else ''} ...", flush=True)
        res[system] = run_system(model, system, store, prompts)
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
