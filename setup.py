"""The fp8 codec's compiled kernel, built with the package: ``lmcache_core._fp8``.

Everything else of the distribution is declared in pyproject.toml. The kernel
(``lmcache_core/csrc``) is compiled here, once per instruction set with runtime
dispatch, so a wheel runs on any CPU of its platform; nothing is compiled at run
time. Where no C compiler is available, or the build fails, the package installs
without the extension and the fp8 codec runs its torch path (slower, the same bytes);
``LMCACHE_FP8_BUILD=require`` makes a failed build an error instead.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MODE = os.environ.get("LMCACHE_FP8_BUILD", "auto")
if MODE not in ("auto", "require", "skip"):
    raise SystemExit(f"LMCACHE_FP8_BUILD={MODE!r}: use auto (build, or fall back to torch), require or skip")

CSRC = "lmcache_core/csrc"
FP8 = Extension(
    "lmcache_core._fp8",
    sources=[f"{CSRC}/fp8_module.c", f"{CSRC}/fp8_generic.c", f"{CSRC}/fp8_avx2.c", f"{CSRC}/fp8_avx512.c"],
    depends=[f"{CSRC}/fp8_kernel.c"],
    # -ffp-contract=off: no fused multiply-add (the torch path rounds every product).
    # -fno-trapping-math lets the compiler vectorize selects (nothing here reads
    # floating-point exception flags). Never -march=native: a wheel built here runs
    # elsewhere; the variants and fp8_module.c's dispatch pick the CPU's best.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-fast-math", "-fvisibility=hidden"],
)


class OptionalBuildExt(build_ext):
    """Build the kernel; on failure, say why and install without it (MODE auto)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as err:  # distutils raises several unrelated types
            self._fallback(err)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as err:
            self._fallback(err)

    def _fallback(self, err: Exception) -> None:
        if MODE == "require":
            raise err
        print(
            f"WARNING: lmcache-core's fp8 kernel was not built ({err}); the fp8 codec will use its torch path. "
            "Install a C compiler and reinstall for the fused kernel.",
            file=sys.stderr,
        )


setup(ext_modules=[] if MODE == "skip" else [FP8], cmdclass={"build_ext": OptionalBuildExt})
