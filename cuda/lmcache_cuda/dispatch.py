"""Which implementation runs the transfers, and why.

Resolved once per process, lazily (the first transfer on CUDA tensors, or a call to
``backend_name()`` / ``available()``), in this order:

1. ``LMCACHE_CUDA_BACKEND=torch`` forces the pure-torch reference.
2. torch must be a CUDA build and see a GPU; otherwise the reference.
3. A prebuilt ``lmcache_cuda._C`` (``LMCACHE_CUDA_BUILD=1`` at install time) is used
   when it imports.
4. Otherwise the sources shipped in ``lmcache_cuda/csrc`` are JIT-compiled with
   ``torch.utils.cpp_extension.load`` (about a minute the first time, cached under
   ``TORCH_EXTENSIONS_DIR``); ``LMCACHE_CUDA_JIT=0`` disables this. The build
   directory is code this process loads: it, and every directory above it up to
   ``/``, must belong to root or this user and be writable by no one else (sticky
   directories such as ``/tmp`` excepted above it), else no JIT build (the reason
   says which directory and what to do).

``LMCACHE_CUDA_BACKEND=cuda`` turns any fallback into an error that carries the reason.
"""

from __future__ import annotations

import os
import stat
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
JIT_NAME = "lmcache_cuda_kernels"
KERNELS = "cuda-kernels"
TORCH = "torch"


@dataclass(frozen=True)
class DispatchStatus:
    name: str  # "cuda-kernels" or "torch"
    reason: str
    module: ModuleType | None = None


_lock = threading.Lock()
_status: DispatchStatus | None = None


def _env(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip().lower()
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


class UnsafeBuildDir(RuntimeError):
    pass


def unsafe_reason(directory: str) -> str | None:
    """Why another user could change what is loaded from ``directory`` (already
    resolved: no symbolic links), or None. The directory must belong to this user
    and be writable by no one else; each directory above it must belong to root or
    this user and be writable by no one else unless sticky (a sticky directory lets
    others create entries, not rename or remove ours)."""
    uid = os.geteuid()
    path = Path(directory)
    for i, p in enumerate([path, *path.parents]):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a plain directory"
        if st.st_uid not in ((uid,) if i == 0 else (0, uid)):
            return f"{p} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and (i == 0 or not st.st_mode & stat.S_ISVTX):
            return f"{p} is writable by other users (mode {st.st_mode & 0o7777:o})"
    return None


def build_directory() -> str:
    """Where the JIT build goes: ``$TORCH_EXTENSIONS_DIR`` or torch's default, resolved,
    one directory per torch and CUDA version; made 0700 and checked with
    :func:`unsafe_reason` (raises :class:`UnsafeBuildDir`)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.path.realpath(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    directory = os.path.join(root, f"{JIT_NAME}-torch{torch.__version__}-cuda{torch.version.cuda}".replace("+", "_"))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    why = unsafe_reason(directory)
    if why is not None:
        raise UnsafeBuildDir(
            f"not building or loading the kernels in {directory}: {why}; set TORCH_EXTENSIONS_DIR to a private "
            "directory, or install the prebuilt extension (LMCACHE_CUDA_BUILD=1)"
        )
    return directory


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    return load(
        name=JIT_NAME,
        build_directory=build_directory(),
        sources=[str(CSRC / "ops.cpp"), str(CSRC / "paged_copy.cu"), str(CSRC / "fp8_paged.cu")],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        extra_include_paths=[str(CSRC)],
        verbose=os.environ.get("LMCACHE_CUDA_VERBOSE", "0") == "1",
    )


def _mode() -> str:
    return _env("LMCACHE_CUDA_BACKEND", "auto", ("auto", "cuda", "torch"))


def _resolve() -> DispatchStatus:
    if _mode() == "torch":
        return DispatchStatus(TORCH, "LMCACHE_CUDA_BACKEND=torch")
    if torch.version.cuda is None:
        return DispatchStatus(TORCH, f"torch {torch.__version__} is not a CUDA build")
    if not torch.cuda.is_available():
        return DispatchStatus(TORCH, "no CUDA device visible (torch.cuda.is_available() is False)")
    try:
        from lmcache_cuda import _C  # type: ignore[attr-defined]

        return DispatchStatus(KERNELS, f"prebuilt extension {_C.__file__}", _C)
    except ImportError as exc:
        prebuilt = f"no usable prebuilt lmcache_cuda._C ({exc})"
    if _env("LMCACHE_CUDA_JIT", "1", ("0", "1")) == "0":
        return DispatchStatus(TORCH, f"{prebuilt}, and LMCACHE_CUDA_JIT=0")
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return DispatchStatus(TORCH, f"{prebuilt}, and no nvcc for the JIT build: set CUDA_HOME")
    try:
        module = _jit_build()
    except Exception as exc:  # the reason is kept, reported and optionally raised
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        detail = " | ".join(lines[-5:])
        return DispatchStatus(
            TORCH,
            f"JIT build of {CSRC} failed ({type(exc).__name__}: {detail}); "
            "rerun with LMCACHE_CUDA_VERBOSE=1 for the compiler output",
        )
    return DispatchStatus(KERNELS, f"JIT-compiled from {CSRC} (CUDA_HOME={CUDA_HOME})", module)


def status() -> DispatchStatus:
    """The resolved backend (resolving, and maybe compiling, on first call)."""
    global _status
    with _lock:
        if _status is None:
            _status = _resolve()
            if _status.name == TORCH and _mode() == "auto" and torch.cuda.is_available():
                warnings.warn(
                    f"lmcache_cuda: using the pure-torch path on a GPU: {_status.reason}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if _status.name == TORCH and _mode() == "cuda":
            raise RuntimeError("LMCACHE_CUDA_BACKEND=cuda but the CUDA kernels are unavailable: " + _status.reason)
        return _status


def backend_name() -> str:
    """``"cuda-kernels"`` or ``"torch"``."""
    return status().name


def backend_reason() -> str:
    """Why that backend is in use (a build error, a CPU-only torch, an env var...)."""
    return status().reason


def available() -> bool:
    """True when the CUDA kernels are loaded and used for CUDA tensors."""
    return status().name == KERNELS


def load_kernels() -> ModuleType:
    """The compiled extension, or RuntimeError with the reason it is unavailable."""
    st = status()
    if st.module is None:
        raise RuntimeError(f"lmcache_cuda kernels unavailable: {st.reason}")
    return st.module


def _reset_for_tests() -> None:
    global _status
    with _lock:
        _status = None
