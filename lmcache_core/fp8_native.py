"""The fp8 codec's fused kernel: ``lmcache_core._fp8``, compiled when the package is
built or installed (``setup.py``), called through :mod:`ctypes`.

The torch path of :mod:`lmcache_core.fp8` makes a dozen passes over a chunk (float32
working copy, maxima, scale, clamp, conversion); the kernel makes one pass to encode
and one to decode, with the same arithmetic in the same order, so both write the same
frames and decode the same values (``tests/core/test_fp8_native.py``). ctypes
releases the GIL for the call: a tier's background threads keep running Python.

The extension holds the kernel once per instruction set (``avx512``, ``avx2`` on
x86-64, built by GCC; ``generic`` everywhere) and lists the ones this CPU runs, best
first; the best is used. It is imported by Python's import system from the installed
package like every other module of it: nothing is compiled, and no library is looked
up or opened in a cache directory, at run time, so no other user's file can become
code this process runs (docs/security.md). Where the package was installed without
the extension (no C compiler at install time), the codec uses the torch path and logs
why once. ``LMCACHE_FP8_KERNEL=torch`` chooses the torch path outright, ``native``
makes a missing kernel an error.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

ENV = "LMCACHE_FP8_KERNEL"
CHOICES = ("auto", "native", "torch")

_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# int lmc_fp8_encode(const void *src, int dtype, int64_t n, float inv_max_up, float min_scale, float limit, uint8_t *out)
_ENCODE = ctypes.CFUNCTYPE(_i, _p, _i, _i64, _f, _f, _f, _p)
# int lmc_fp8_decode(const uint8_t *payload, int64_t n, int dtype, float limit, void *dst)
_DECODE = ctypes.CFUNCTYPE(_i, _p, _i64, _i, _f, _p)

_lock = threading.Lock()
_state: dict[str, object] = {}


class KernelUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Kernel:
    """One variant of the compiled kernel: ``encode`` and ``decode`` take the
    arguments of ``lmcache_core/csrc/fp8_kernel.c``'s functions (addresses as ints)."""

    variant: str
    encode: Callable[..., int]
    decode: Callable[..., int]


def _extension() -> Any:
    try:
        return importlib.import_module(f"{__package__}._fp8")
    except ImportError as err:
        raise KernelUnavailable(
            f"lmcache-core was installed without its compiled fp8 kernel ({err}); "
            "reinstall it where a C compiler is available (LMCACHE_FP8_BUILD=require makes a failed build an error)"
        ) from None


def variants() -> list[Kernel]:
    """Every variant of the kernel this CPU runs, best first (tests hold each one to
    the torch path)."""
    return [Kernel(name, _ENCODE(enc), _DECODE(dec)) for name, enc, dec in _extension().variants()]


def kernel() -> Kernel | None:
    """The kernel's best variant for this CPU, or None where the torch path is to be
    used (see the module docstring). Chosen once per process."""
    if "kernel" in _state:  # the common case, without the lock
        return _state["kernel"]  # type: ignore[return-value]
    with _lock:
        if "kernel" in _state:
            return _state["kernel"]  # type: ignore[return-value]
        choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if choice not in CHOICES:
            raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
        found: Kernel | None = None
        if choice != "torch":
            try:
                found = variants()[0]
            except KernelUnavailable as err:
                if choice == "native":
                    raise KernelUnavailable(f"{ENV}=native but the fp8 kernel is unavailable: {err}") from None
                log.warning("fp8 codec: using the torch path (several times slower): %s", err)
        _state["kernel"] = found
        return found


def reset() -> None:
    """Forget the chosen kernel (tests switch paths with the environment variable)."""
    with _lock:
        _state.clear()
