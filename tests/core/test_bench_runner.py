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


def _output_defaults(path: Path) -> dict[str, str | None]:
    """``--out`` / ``--json`` of a script's parsers: the source of each default (None: none)."""
    text = path.read_text()
    found: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = {a.value for a in node.args if isinstance(a, ast.Constant)}
            for name in names & {"--out", "--json"}:
                default = next((k.value for k in node.keywords if k.arg == "default"), None)
                if isinstance(default, ast.Constant) and default.value is None:
                    default = None
                found[name] = None if default is None else ast.get_source_segment(text, default)
    return found


def test_results_go_to_a_folder_the_user_names_and_git_ignores() -> None:
    """A bench writes its results where ``--out`` / ``--json`` says; by default nowhere,
    or under ``bench/results/``, which git ignores (results are outputs, not sources)."""
    scripts = sorted((ROOT / "bench").rglob("*.py"))
    outputs = {p: _output_defaults(p) for p in scripts}
    assert sum(1 for o in outputs.values() if o) >= 10  # control: the options are seen
    bad = {
        f"{p.relative_to(ROOT)} {name}": default
        for p, o in outputs.items()
        for name, default in o.items()
        if default is not None and '"results"' not in default
    }
    assert bad == {}, f"results written outside bench/results/ by default: {bad}"
    assert "bench/results/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "OUT=${OUT:-bench/results}" in (ROOT / "bench" / "gpu_check.sh").read_text()
