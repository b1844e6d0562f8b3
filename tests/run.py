"""Run the whole test suite in two pytest processes.

Tests that start vLLM in the test process (marker ``vllm``) run in a process of
their own: other tests import flask (moto's S3 server), and vLLM's CPU start-up
inspects every loaded module's attributes, which flask's request proxies refuse
outside an app context. Arguments are passed to both runs; a run that selects no
test (pytest's exit code 5) is not a failure.

    python tests/run.py [pytest args...]
"""

from __future__ import annotations

import subprocess
import sys

NO_TESTS = 5


def main(argv: list[str]) -> int:
    worst = 0
    # Collection imports every test module, deselected or not: keep the tier tests
    # (some import moto's server: test_s3*, test_tier_verdicts) out of the vLLM run.
    # The vLLM tests live under tests/connector.
    phases = [("not vllm", []), ("vllm", ["--ignore-glob=*/backends/*"])]
    for marker, extra in phases:
        print(f"\n=== pytest -m '{marker}' ===", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", "-m", marker, *extra, *argv])
        if rc not in (0, NO_TESTS):
            worst = worst or rc
    return worst


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
