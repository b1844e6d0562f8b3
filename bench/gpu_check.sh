#!/usr/bin/env bash
# The GPU check in one command, from a checkout on a machine with torch+CUDA and nvcc
# (vLLM not needed): JIT-builds lmcache_cuda for the visible GPU, runs tests/cuda, the
# adapter/engine checks, the speed table and the layer-by-layer overlap
# (bench/tools/gpu_check.py). Output: $OUT/gpu_check.log and $OUT/gpu_check.json
# (OUT defaults to bench/results). Extra arguments go to gpu_check.py (--quick ...).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/connector:$PWD/cuda${PYTHONPATH:+:$PYTHONPATH}"
# Build for the visible GPU only (a minute instead of several).
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST=$(python3 -c 'import torch; m, n = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0); print(f"{m}.{n}")')
    export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/lmcache-torch-extensions}
python3 bench/tools/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
