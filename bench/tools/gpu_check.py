"""One prepared run on a CUDA GPU: build lmcache_cuda, run tests/cuda, check the
connector's layout adapters and the engine below vLLM, measure the copies against a
pinned-memory memcpy of the same bytes, measure layer-by-layer overlap; a short
table last.

    python bench/tools/gpu_check.py [--out DIR] [--quick]      # or: bash bench/gpu_check.sh

Needs torch with CUDA and nvcc (for the kernels; without them the torch path is
measured and the table says so). vLLM is not needed: the adapters, the layer pipeline
and the engine are driven directly, with vLLM 0.32's real per-layer KV layouts built
as plain CUDA tensors (lmcache_cuda.testing.vllm_kv_caches). Without a GPU it runs
what it can on the CPU (a dry run) and says so. Never part of the test pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# the sections, in bench/tools/gpu/ (common: paths, results, the section wrapper)
from gpu import common
from gpu.common import RESULTS, ROOT, TABLE, log
from gpu.engine import engine_round_trip
from gpu.fp8 import fp8_gpu
from gpu.environment import build, environment, pytest_cuda
from gpu.layerwise import layerwise
from gpu.profiling import profile
from gpu.speed import speed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        default=os.environ.get("OUT", str(ROOT / "bench" / "results")),
        help="where gpu_check.json goes (default $OUT, else bench/results/, which git ignores)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pytest-timeout", type=float, default=300)
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument(
        "--only", nargs="+", choices=["pytest", "engine", "speed", "layerwise", "fp8", "profile"], help="run these sections only"
    )
    p.add_argument("--trace", action="store_true", help="write a torch.profiler trace of one pipelined step to --out")
    a = p.parse_args(argv)
    if a.trace:
        common.TRACE_DIR = Path(a.out)
        common.TRACE_DIR.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not torch.cuda.is_available():
        log("gpu_check: no CUDA GPU visible: a dry run of the CPU parts")
    environment()
    build()
    want = set(a.only or ["pytest", "engine", "speed", "layerwise", "fp8"])
    if "pytest" in want and not a.skip_pytest:
        pytest_cuda(a.pytest_timeout)
    if "layerwise" in want:
        layerwise(a.quick)
    if "speed" in want:
        speed(a.quick)
    if "fp8" in want:
        fp8_gpu(a.quick)
    if "engine" in want:
        engine_round_trip(a.quick)
    if "profile" in want:
        profile()
    RESULTS["table"] = TABLE
    RESULTS["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    env = RESULTS.get("environment", {})
    log(
        f"\n=== summary: {env.get('gpu')} | driver {env.get('driver')} | torch {env.get('torch')} CUDA {env.get('torch_cuda')} | {RESULTS['seconds']} s ==="
    )
    w = max(len(c) for c, _, _ in TABLE) if TABLE else 10
    for check, fig, verdict in TABLE:
        log(f"{check:<{w}}  {verdict:<6} {fig}")
    failed = [c for c, _, v in TABLE if v == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
