"""The fp8 codec's fused kernel: ``fp8_kernel.c`` built once per machine with the C
compiler and loaded with :mod:`ctypes`.

The torch path of :mod:`lmcache_core.fp8` makes a dozen passes over a chunk (float32
working copy, maxima, scale, clamp, conversion); the kernel makes one pass to encode
and one to decode, with the same arithmetic in the same order, so both write the same
frames and decode the same values (``tests/core/test_fp8_native.py``). ctypes
releases the GIL for the call: a tier's background threads keep running Python.

The library is built on first use with ``cc -O3 -march=native`` (about a second) into
``$LMCACHE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/lmcache-core`` or
``~/.cache/lmcache-core``), under a name hashed from the source, the flags, the
compiler's version and this CPU's feature flags: a cache directory shared by
different machines never hands one a library built for another CPU. A library is
code this process runs, so the directory and the file must belong to this user and
be writable by no one else, or the kernel is not loaded (the torch path runs, with
the reason logged). The build writes
a private file and renames it into place, so processes building at once do not
collide. Where there is no compiler, or the build or the load fails, the codec uses
the torch path and logs why once. ``LMCACHE_FP8_KERNEL=torch`` chooses the torch path
outright, ``native`` makes a failed build an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fp8_kernel.c")
# -ffp-contract=off: no fused multiply-add (the torch path rounds every product).
# -fno-trapping-math lets the compiler vectorize selects (nothing here reads
# floating-point exception flags; results are unchanged). On x86, 512-bit vectors
# where the CPU has them: the encode's quantization is written for AVX-512
# (fp8_kernel.c), 1.6x faster than the compiler's default width.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-trapping-math", "-fno-fast-math") + (
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
ENV = "LMCACHE_FP8_KERNEL"
CHOICES = ("auto", "native", "torch")
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict[str, object] = {}


class KernelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("LMCACHE_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "lmcache-core"
    try:
        return Path.home() / ".cache" / "lmcache-core"
    except RuntimeError:  # no home directory: a private one under the temporary directory
        return Path(tempfile.gettempdir()) / f"lmcache-core-{os.getuid()}"


def _private(path: Path) -> str | None:
    """Why ``path`` (the cache directory or a library in it) must not be trusted: a
    library is code this process runs, so it and its directory must belong to this
    user and be writable by no one else. None when it is fine."""
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"{path} is writable by other users (mode {st.st_mode & 0o777:o})"
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise KernelUnavailable("no C compiler (cc, gcc or clang) on PATH")


def build(directory: Path | None = None, extra: tuple[str, ...] = ()) -> Path:
    """The kernel's shared library, built unless this machine has it already;
    ``extra`` flags follow :data:`FLAGS` (tests build the portable variant with
    ``-mno-avx512f``)."""
    flags = FLAGS + extra
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelUnavailable(f"{cc} --version failed: {err}") from None
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_flags().encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    lib = directory / f"fp8_kernel-{digest}.so"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _private(directory) or (_private(lib) if lib.exists() else None)
    except OSError as err:
        raise KernelUnavailable(f"cannot use {directory}: {err}; set LMCACHE_CACHE_DIR") from None
    if why is not None:
        raise KernelUnavailable(f"not loading the kernel from there: {why}; set LMCACHE_CACHE_DIR to a private directory")
    if lib.exists():
        return lib
    try:
        fd, tmp = tempfile.mkstemp(prefix=".fp8_kernel-", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as err:
        raise KernelUnavailable(f"cannot write to {directory}: {err}; set LMCACHE_CACHE_DIR") from None
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # the linker's mode follows the umask, which may let others write
        os.replace(tmp, lib)
    except subprocess.TimeoutExpired:
        raise KernelUnavailable(f"{cc} took over {BUILD_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load(path: Path) -> ctypes.CDLL:
    dll = ctypes.CDLL(str(path))
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    dll.lmc_fp8_encode.argtypes = [p, i, i64, f, f, f, p]
    dll.lmc_fp8_encode.restype = i
    dll.lmc_fp8_decode.argtypes = [p, i64, i, f, p]
    dll.lmc_fp8_decode.restype = i
    return dll


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel, or None where the torch path is to be used (see the module
    docstring). Built and loaded once per process."""
    if "dll" in _state:  # the common case, without the lock
        return _state["dll"]  # type: ignore[return-value]
    with _lock:
        if "dll" in _state:
            return _state["dll"]  # type: ignore[return-value]
        choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if choice not in CHOICES:
            raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
        dll: ctypes.CDLL | None = None
        if choice != "torch":
            try:
                dll = _load(build())
            except (KernelUnavailable, OSError) as err:
                if choice == "native":
                    raise KernelUnavailable(f"{ENV}=native but the fp8 kernel is unavailable: {err}") from None
                log.warning("fp8 codec: using the torch path (several times slower): %s", err)
        _state["dll"] = dll
        return dll


def reset() -> None:
    """Forget the loaded kernel (tests switch paths with the environment variable)."""
    with _lock:
        _state.clear()
