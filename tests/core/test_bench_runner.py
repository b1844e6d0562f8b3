"""``tox -e bench`` runs exactly the benchmarks, and each of them takes ``--quick``
(``tox -e bench -- --quick``): no tool that needs its own arguments is picked up."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("bench_run_all", ROOT / "bench" / "run_all.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _options(path: Path) -> set[str]:
    """The option strings a script's argparse parsers declare."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return found


def test_every_benchmark_takes_quick_and_only_benchmarks_run() -> None:
    picked = _runner().benchmarks()
    assert len(picked) >= 20 and all(p.name.startswith("bench_") for p in picked)
    missing = [p.name for p in picked if "--quick" not in _options(p)]
    assert missing == [], f"benchmarks without --quick: {missing}"
    # tools need arguments of their own: never picked
    tools = [p.name for p in picked if "--base" in _options(p)]
    assert tools == [] and (ROOT / "bench" / "tools" / "before_after.py").exists()
    # control: the check sees an option where one is declared, and not where none is
    assert "--base" in _options(ROOT / "bench" / "tools" / "before_after.py")
    assert "--quick" not in _options(ROOT / "bench" / "run_all.py")
