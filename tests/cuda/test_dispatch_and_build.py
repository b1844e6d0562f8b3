"""Backend selection, its reasons and env vars, and the install-time build switch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lmcache_cuda
from lmcache_cuda import dispatch, ops, reference

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"


@pytest.fixture
def fresh_backend(monkeypatch):
    for name in ("LMCACHE_CUDA_BACKEND", "LMCACHE_CUDA_JIT"):
        monkeypatch.delenv(name, raising=False)
    dispatch._reset_for_tests()
    yield monkeypatch
    dispatch._reset_for_tests()


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch path")
def test_cpu_torch_uses_reference_and_says_why(fresh_backend):
    assert lmcache_cuda.backend_name() == "torch"
    assert not lmcache_cuda.available()
    assert "not a CUDA build" in lmcache_cuda.backend_reason()
    with pytest.raises(RuntimeError, match="not a CUDA build"):
        lmcache_cuda.load_kernels()


def test_forced_torch_backend(fresh_backend):
    fresh_backend.setenv("LMCACHE_CUDA_BACKEND", "torch")
    assert lmcache_cuda.backend_name() == "torch"
    assert lmcache_cuda.backend_reason() == "LMCACHE_CUDA_BACKEND=torch"


def test_bad_env_value_is_an_error(fresh_backend):
    fresh_backend.setenv("LMCACHE_CUDA_BACKEND", "gpu")
    with pytest.raises(ValueError, match="LMCACHE_CUDA_BACKEND='gpu'"):
        lmcache_cuda.backend_name()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_required_kernels_fail_loudly_without_gpu(fresh_backend):
    fresh_backend.setenv("LMCACHE_CUDA_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="LMCACHE_CUDA_BACKEND=cuda but"):
        lmcache_cuda.backend_name()


def test_cpu_tensors_always_use_reference(fresh_backend):
    fresh_backend.setenv("LMCACHE_CUDA_BACKEND", "cuda")  # must not even be consulted
    kv = [torch.zeros((2, 1, 16, 8))]
    assert ops.implementation(kv) is reference


def test_import_compiles_nothing():
    code = "import lmcache_cuda, lmcache_cuda.dispatch as b; assert b._status is None"
    subprocess.run([sys.executable, "-c", code], check=True)


def _setup_py(env_value: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("LMCACHE_CUDA_BUILD", None)
    if env_value is not None:
        env["LMCACHE_CUDA_BUILD"] = env_value
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=CUDA_DIR, env=env, capture_output=True, text=True)


def test_default_install_builds_nothing():
    res = _setup_py(None)
    assert res.returncode == 0, res.stderr
    assert "lmcache-cuda" in res.stdout or "lmcache_cuda" in res.stdout


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch path")
def test_forced_build_without_cuda_torch_says_why():
    res = _setup_py("1")
    assert res.returncode != 0
    assert "LMCACHE_CUDA_BUILD=1" in res.stderr and "no CUDA" in res.stderr


def test_bad_build_flag():
    res = _setup_py("yes")
    assert res.returncode != 0 and "LMCACHE_CUDA_BUILD='yes'" in res.stderr


def test_sources_ship_in_the_package():
    for name in ("ops.cpp", "paged_copy.cu", "paged_copy.cuh"):
        assert (dispatch.CSRC / name).is_file()


def test_the_jit_build_directory_must_be_private_up_to_the_root(tmp_path, monkeypatch):
    """Hardening round 3: the JIT-built kernels are code this process loads, so the
    build directory and every directory above it must be out of other users' reach
    (a writable parent lets them swap the directory between build and load)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert dispatch.unsafe_reason(str(private)) is None  # control: tmp_path sits under sticky /tmp
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by all, not sticky
    (shared / "cache").mkdir(mode=0o700)
    assert "shared is writable by other users" in dispatch.unsafe_reason(str(shared / "cache"))
    private.chmod(0o770)
    assert "private is writable by other users" in dispatch.unsafe_reason(str(private))
    private.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    assert "not a plain directory" in dispatch.unsafe_reason(str(link))
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(private, 1, 1)
        assert "belongs to uid 1" in dispatch.unsafe_reason(str(private))
        os.chown(private, 0, 0)
    # build_directory resolves TORCH_EXTENSIONS_DIR (a link to a private place is fine)
    # and refuses a shared one, saying what to do
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(link))
    assert Path(dispatch.build_directory()).parent == private
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(shared / "cache"))
    with pytest.raises(dispatch.UnsafeBuildDir, match="writable by other users.*TORCH_EXTENSIONS_DIR"):
        dispatch.build_directory()
