"""The fast checks, run before the slow suite: ruff (lint), mypy (types), and a
wheel of every distribution. One source for ``tox -e lint`` and ``.ci/run``, which
runs it with the test environment's interpreter so nothing is installed twice.

    python .ci/lint.py [WORK_DIR]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    work = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="lmcache-lint-"))
    steps = [
        ["-m", "ruff", "check", "."],
        ["-m", "ruff", "format", "--check", "."],
        ["-m", "mypy"],
        [str(ROOT / ".ci" / "build_wheels.py"), str(work / "wheels")],
    ]
    for step in steps:
        print(f"\n=== {' '.join(step)} ===", flush=True)
        rc = subprocess.call([sys.executable, *step], cwd=ROOT)
        if rc != 0:
            print(f"lint: {' '.join(step)} failed (exit status {rc})", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
