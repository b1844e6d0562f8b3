"""Optional ahead-of-time build of lmcache_cuda._C.

By default this installs the pure-Python package only (the kernels are JIT-compiled
at first use, see docs/cuda.md), so `pip install -e cuda` never fails for lack of
nvcc or a CUDA build of torch. With LMCACHE_CUDA_BUILD=1 it builds the extension now;
that needs torch (a CUDA build) importable by the build, i.e.
`LMCACHE_CUDA_BUILD=1 pip install --no-build-isolation -e cuda`.
"""

import os

from setuptools import setup

ext_modules = []
cmdclass = {}
flag = os.environ.get("LMCACHE_CUDA_BUILD", "0")
if flag not in ("0", "1"):
    raise SystemExit(f"LMCACHE_CUDA_BUILD={flag!r}: use 1 (build the CUDA extension now) or 0")
if flag == "1":
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        raise SystemExit(
            f"LMCACHE_CUDA_BUILD=1 needs torch in the build environment: run pip with --no-build-isolation ({exc})"
        ) from exc
    if torch.version.cuda is None or CUDA_HOME is None:
        raise SystemExit(
            f"LMCACHE_CUDA_BUILD=1 but torch {torch.__version__} has no CUDA "
            f"(torch.version.cuda={torch.version.cuda}) or nvcc was not found "
            f"(CUDA_HOME={CUDA_HOME}); unset it to install the pure-Python package"
        )
    ext_modules = [
        CUDAExtension(
            "lmcache_cuda._C",
            sources=["lmcache_cuda/csrc/ops.cpp", "lmcache_cuda/csrc/paged_copy.cu", "lmcache_cuda/csrc/fp8_paged.cu"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
