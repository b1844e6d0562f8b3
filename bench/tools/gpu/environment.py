"""The set-up sections: the machine (environment), the lmcache_cuda build, tests/cuda."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import lmcache_cuda
import torch

from .common import RESULTS, ROOT, TABLE, log, section, sh


@section("environment")
def environment() -> None:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "driver": sh(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
                "--format=csv,noheader",
            ]
        ),
        "nvcc": sh(["nvcc", "--version"]).splitlines()[-1:] or None,
        "cpu": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["sm"] = f"{p.major}.{p.minor}"
        env["multiprocessors"] = p.multi_processor_count
    RESULTS["environment"] = env
    for k, v in env.items():
        log(f"  {k}: {v}")


@section("build")
def build() -> None:
    t0 = time.perf_counter()
    name, reason = lmcache_cuda.backend_name(), lmcache_cuda.backend_reason()
    secs = time.perf_counter() - t0
    RESULTS["build"] = {"backend": name, "reason": reason, "seconds": round(secs, 1)}
    log(f"  backend: {name} ({reason}) in {secs:.1f} s")
    ok = name == "cuda-kernels"
    TABLE.append(
        (
            "lmcache_cuda build",
            f"{name}, {secs:.0f} s",
            "PASS" if ok else ("n/a (no GPU)" if not torch.cuda.is_available() else "FAIL"),
        )
    )


@section("tests/cuda")
def pytest_cuda(timeout: float) -> None:
    env = dict(os.environ)
    if torch.cuda.is_available():
        env["LMCACHE_CUDA_BACKEND"] = "cuda"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "connector"), str(ROOT / "cuda"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-rfEs", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    for line in out[-25:]:
        log("  " + line)
    summary = next((ln for ln in reversed(out) if " passed" in ln or " failed" in ln or " error" in ln), "no summary")
    RESULTS["pytest"] = {"rc": proc.returncode, "summary": summary, "seconds": round(time.perf_counter() - t0, 1)}
    TABLE.append(("pytest tests/cuda", summary.strip("= "), "PASS" if proc.returncode == 0 else "FAIL"))
