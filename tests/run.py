"""Run the whole test suite in two pytest runs, each over two processes.

Tests that start vLLM in the test process (marker ``vllm``) run in a pytest run of
their own: other tests import flask (moto's S3 server), and vLLM's CPU start-up
inspects every loaded module's attributes, which flask's request proxies refuse
outside an app context. Arguments are passed to both runs; a run that selects no
test (pytest's exit code 5) is not a failure.

Each run spreads its tests over ``LMCACHE_TEST_JOBS`` pytest-xdist workers (default:
2 where this process may run on 2 cores or more; 1 runs them in one process, as does
passing ``-n`` yourself):

- the vLLM run test by test (``worksteal``: one file, tests/connector/test_e2e_hybrid.py,
  is a third of the time); an engine's step is mostly one Python thread, and each
  worker's engines use one OpenMP thread (tests/connector/conftest.py);
- the other run file by file (``loadfile``): a file's servers (redis, moto, Mooncake's
  master, peer nodes) start once in one worker. Its tests mostly wait on sockets and
  subprocesses; their deadlines have held beside a second worker (a clean run on 2
  cores: 655 s against about 1,180 s in one process).

    python tests/run.py [pytest args...]
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

NO_TESTS = 5


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as the workers' conftest
    reads it), not merely the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def workers(argv: list[str], dist: str) -> list[str]:
    """pytest-xdist arguments for one run (``dist``: xdist's distribution mode): none
    when one job is asked for, when xdist is missing, or when the caller chose ``-n`` /
    ``--numprocesses``."""
    if any(a == "-n" or a.startswith(("-n=", "--numprocesses")) or (a.startswith("-n") and a[2:].isdigit()) for a in argv):
        return []
    raw = os.environ.get("LMCACHE_TEST_JOBS", "")
    try:
        jobs = int(raw) if raw else min(2, usable_cores())
    except ValueError:
        raise SystemExit(f"LMCACHE_TEST_JOBS={raw!r}: expected a number of workers (1: no parallel run)") from None
    if jobs <= 1 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(jobs), "--dist", dist]


def vllm_workers(argv: list[str]) -> list[str]:
    """The vLLM run's: test by test."""
    return workers(argv, "worksteal")


def other_workers(argv: list[str]) -> list[str]:
    """The other run's: file by file, so a file's servers start once."""
    return workers(argv, "loadfile")


def main(argv: list[str]) -> int:
    worst = 0
    # Collection imports every test module, deselected or not: keep the tier tests
    # (some import moto's server: test_s3*, test_tier_verdicts) out of the vLLM run.
    # The vLLM tests live under tests/connector.
    phases = [("not vllm", other_workers(argv)), ("vllm", ["--ignore-glob=*/backends/*", *vllm_workers(argv)])]
    for marker, extra in phases:
        print(f"\n=== pytest -m '{marker}' {' '.join(extra)} ===", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", "-m", marker, *extra, *argv])
        if rc not in (0, NO_TESTS):
            worst = worst or rc
    return worst


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
