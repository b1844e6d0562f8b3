"""The sections of the GPU check (bench/tools/gpu_check.py runs them; bash
bench/gpu_check.sh runs that): ``common`` (paths, results, the section wrapper,
helpers), ``environment`` (machine, build, tests/cuda), ``engine`` (the engine round
trip), ``speed`` (the copies against memcpy), ``layerwise`` (the layer pipeline's
overlap), ``profiling`` (where the host time goes)."""
