"""What the GPU check's sections share: the path set-up, the results and the table they
fill, the section wrapper that logs and records each, and the helpers (a Llama-like KV,
wall-clock timing, a buffer that releases nothing)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[3]
for sub in ("", "connector", "cuda"):
    p = str(ROOT / sub)
    if p not in sys.path:
        sys.path.insert(0, p)

from lmcache_cuda.testing import vllm_kv_caches  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from lib.timing import time_cuda as _time_cuda  # noqa: E402,F401  (CUDA-event timing, shared)

BAR = 0.8
HIDE_GOAL = 0.8
RESULTS: dict[str, Any] = {"sections": {}}
TABLE: list[tuple[str, str, str]] = []  # (check, figure, verdict)
# where --trace puts a torch.profiler trace of one pipelined step (set by main)
TRACE_DIR: Path | None = None


def log(*a: Any) -> None:
    print(*a, flush=True)


def section(name: str, gpu_only: str | None = None) -> Callable:
    """Log, time and record a section; one that raises is a FAIL row, not a crash.
    ``gpu_only``: the section needs CUDA; without it, it is skipped with that note
    (where the same path is covered on CPU, or "" for no note)."""

    def wrap(fn: Callable) -> Callable:
        def run(*args: Any, **kw: Any) -> Any:
            log(f"\n=== {name} ===")
            if gpu_only is not None and not torch.cuda.is_available():
                log(f"  no GPU: skipped{f' ({gpu_only})' if gpu_only else ''}")
                RESULTS["sections"][name] = {"ok": True, "skipped": "no GPU"}
                return None
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kw)
                RESULTS["sections"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1)}
                return out
            except Exception as err:
                traceback.print_exc()
                RESULTS["sections"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                TABLE.append((name, f"ERROR {type(err).__name__}", "FAIL"))
                return None

        return run

    return wrap


def sh(cmd: list[str], timeout: float = 60) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except Exception as err:
        return f"({type(err).__name__})"


class _Held:
    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t

    def release(self) -> None:
        pass


def _llama(tokens: int, device: str, layout: str = "LBNHC", layers: int = 32, seed: int = 0):
    """Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16, block 16: 128 KiB per
    token) with room for ``tokens`` tokens twice over."""
    blocks = max(64, 2 * -(-tokens // 16))
    return vllm_kv_caches(layout, layers, blocks, 8, 16, 256, torch.bfloat16, device, seed=seed)


def _wall(fn: Callable[[], object], iters: int, sync: bool) -> float:
    for _ in range(2):
        fn()
    if sync:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
