"""Run every benchmark, ``bench/bench_*.py``, in turn, each in its own interpreter (so
one benchmark's threads, memory or crash cannot skew or stop the next). Arguments
(``--quick``) are passed through; every benchmark takes ``--quick``. Tools that need
arguments of their own (``bench/tools/``: ``before_after.py``, ``gpu_check.py`` and its
sections in ``bench/tools/gpu/``) and the shared modules (``bench/lib/``) are not
benchmarks and are never run here (tests/bench/test_bench_layout.py checks both). Exit
status 1 if any benchmark failed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def benchmarks() -> list[Path]:
    return sorted(Path(__file__).resolve().parent.glob("bench_*.py"))


def main(argv: list[str]) -> int:
    scripts = benchmarks()
    failed = []
    for script in scripts:
        print(f"=== {script.name} {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(script), *argv])
        print(f"=== {script.name}: exit {rc} in {time.perf_counter() - t0:.1f}s\n", flush=True)
        if rc != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    print(f"all {len(scripts)} benchmarks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
