"""Build a wheel of every distribution in the repository (``pip wheel --no-deps``
with the environment's own setuptools, so nothing is downloaded per build) into a
fresh directory and check what each one ships: its packages with their ``py.typed``,
the native sources they build at run time (``*.c``, ``*.cpp``, ``*.cu``, ``*.cuh``),
the extensions they compile when built (the core's fp8 kernel), its entry points.
``package = skip`` in tox never builds them, so a broken build configuration would
otherwise only show at release time.

    python .ci/build_wheels.py OUT_DIR
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE_SOURCES = ("*.c", "*.cpp", "*.cu", "*.cuh")
# compiled when the distribution is built (setup.py), never at run time
COMPILED = {"lmcache-core": "lmcache_core/_fp8."}


def distributions() -> list[Path]:
    return sorted(p.parent for p in ROOT.glob("**/pyproject.toml") if not {".venv", ".tox"} & set(p.parts))


def main(out: Path) -> int:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    failures = []
    for dist in distributions():
        meta = tomllib.loads((dist / "pyproject.toml").read_text())
        name = meta["project"]["name"]
        before = set(out.iterdir())
        res = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(dist)],
            capture_output=True,
            text=True,
        )
        built = sorted(set(out.iterdir()) - before)
        if res.returncode != 0 or len(built) != 1:
            failures.append(f"{name}: pip wheel failed:\n{res.stdout}{res.stderr}")
            continue
        files = zipfile.ZipFile(built[0]).namelist()
        typed = [f for f in files if f.endswith("/py.typed")]
        if not typed:
            failures.append(f"{name}: {built[0].name} ships no py.typed")
        if meta["project"].get("entry-points") and not any(f.endswith("entry_points.txt") for f in files):
            failures.append(f"{name}: {built[0].name} lost its entry points")
        sources = {
            str(f.relative_to(dist))
            for pattern in NATIVE_SOURCES
            for f in dist.glob(f"*/**/{pattern}")
            if (f.relative_to(dist).parts[0] + "/__init__.py") in files
        }
        if name in COMPILED and not any(f.startswith(COMPILED[name]) for f in files):
            failures.append(f"{name}: {built[0].name} lacks its compiled {COMPILED[name]}* (setup.py's build failed?)")
        if sources - set(files):
            failures.append(f"{name}: {built[0].name} lacks {sorted(sources - set(files))} (package-data)")
        print(f"{built[0].name}: {len(files)} files, {', '.join(typed + sorted(sources))}")
    for msg in failures:
        print(f"error: {msg}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
