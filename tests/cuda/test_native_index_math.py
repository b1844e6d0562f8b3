"""The kernels' index math, run on the host (no GPU): compiles
cuda/native_tests/index_math_check.cpp, which drives the same __host__ __device__ steps
the CUDA kernels run over every vector width and layout. Needs a C++ compiler and the
CUDA headers (cuda_runtime.h); skipped without them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"


def _cuda_include() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime.h").is_file():
            return Path(c) / "include"
    return None


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.skipif(_cuda_include() is None, reason="no CUDA headers (cuda_runtime.h)")
def test_index_math_on_host(tmp_path):
    exe = tmp_path / "index_math_check"
    subprocess.run(
        [
            "c++",
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{_cuda_include()}",
            f"-I{CUDA_DIR / 'lmcache_cuda' / 'csrc'}",
            str(CUDA_DIR / "native_tests" / "index_math_check.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert " 0 failures" in res.stdout
