"""Before/after in one run: the same benchmark against the code of an older revision and
against the working tree, taking turns, so a change is judged by figures measured side
by side (a refactor "within noise", a feature's cost) rather than against a number
from another day.

    python bench/tools/before_after.py --base REV [--rounds N] BENCH [BENCH ARGS ...]

    python bench/tools/before_after.py --base a3410f9^ --rounds 2 bench_connector.py --quick
    python bench/tools/before_after.py --base a3410f9^ bench_burst.py --quick
    python bench/tools/before_after.py --base a3410f9^ bench_serving.py --quick --arms lmc-cpu --workloads docqa

``REV`` is checked out into a temporary git worktree. Both sides run *this* tree's
``bench/BENCH`` (so the measurement is the same) with ``--json PATH`` appended, in a
fresh process whose ``PYTHONPATH`` puts one side's packages (``lmcache_core``, the
connector, every backend) ahead of the installed ones; each run first checks which
files it imports. Rounds alternate the order (before, after), (after, before), ...
The table shows every figure the bench reports in its JSON: medians over rounds,
after/before, and the per-round values. Lower is better for every figure here
(seconds, ratios of seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def package_paths(tree: Path) -> list[str]:
    """The directories that hold this tree's importable packages."""
    paths = [tree, tree / "connector"]
    paths += sorted(p for p in (tree / "backends").iterdir() if p.is_dir() and any(p.glob("lmcache_backend_*")))
    return [str(p) for p in paths]


def side_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*package_paths(tree), str(BENCH)])
    return env


def check_imports(tree: Path) -> None:
    """Refuse to measure if a side would import the other side's code."""
    code = (
        "import lmcache_core, lmcache_connector, lmcache_backend_disk; "
        "print(lmcache_core.__file__); print(lmcache_connector.__file__); print(lmcache_backend_disk.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=side_env(tree), cwd=tree, capture_output=True, text=True, check=True)
    for f in out.stdout.split():
        if not Path(f).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{tree}: imports {f} from outside the tree; cannot measure this side")


def run_side(tree: Path, bench: str, args: list[str], out: Path, log: Path) -> dict[str, float]:
    cmd = [sys.executable, str(BENCH / bench), *args, "--json", str(out)]
    with open(log, "w") as f:
        p = subprocess.run(cmd, env=side_env(tree), cwd=tree, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"{bench} failed on {tree} (exit {p.returncode}); see {log}")
    data = json.loads(out.read_text())
    flat = {f"{k} (s)": v for k, v in data.get("seconds", {}).items()}
    flat |= dict(data.get("ratios", {}).items())
    if "identical" in data:
        flat["greedy tokens identical (1 = yes)"] = float(bool(data["identical"]))
    return flat


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision measured as 'before' (anything git rev-parse takes)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per side, alternating the order (default 2)")
    ap.add_argument(
        "bench", help="a script in bench/ that takes --json PATH (bench_connector.py, bench_burst.py, bench_serving.py)"
    )
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    base = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", a.base], capture_output=True, text=True, check=True)
    rev = base.stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory(prefix="lmcache-before-") as d:
        tmp = Path(d)
        old = tmp / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), rev], check=True)
        try:
            sides = {"before": old, "after": ROOT}
            for tree in sides.values():
                check_imports(tree)
            print(f"{a.bench} {' '.join(a.bench_args)}: before = {rev}, after = the working tree (HEAD {head.stdout.strip()})")
            results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for r in range(a.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for side in order:
                    log = tmp / f"{side}-{r}.log"
                    print(f"  round {r + 1}/{a.rounds}: {side} ...", flush=True)
                    results[side].append(run_side(sides[side], a.bench, a.bench_args, tmp / f"{side}-{r}.json", log))
                    sys.stdout.write("".join(f"    {line}\n" for line in log.read_text().splitlines()[-6:]))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    names = [k for k in results["after"][0] if all(k in x for x in results["before"] + results["after"])]
    print(f"\n| figure | before ({rev}) | after | after / before | rounds before | rounds after |")
    print("|---|---|---|---|---|---|")
    for k in names:
        b = statistics.median(x[k] for x in results["before"])
        f = statistics.median(x[k] for x in results["after"])
        ratio = f"{f / b:.3f}" if b else "n/a"
        rb = " ".join(f"{x[k]:.4g}" for x in results["before"])
        ra = " ".join(f"{x[k]:.4g}" for x in results["after"])
        print(f"| {k} | {b:.4g} | {f:.4g} | {ratio} | {rb} | {ra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
