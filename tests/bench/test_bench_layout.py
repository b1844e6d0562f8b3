"""bench/'s layout: ``tox -e bench`` runs exactly the benchmarks, and each of them
takes ``--quick`` (``tox -e bench -- --quick``): no tool that needs its own arguments
and no shared module is picked up. No benchmark or tool imports a benchmark (what they
share is in ``bench/lib/``), no shared module is over 500 lines, and results go to a
folder the user names. All read from the source (AST), nothing runs."""

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
    # tools need arguments of their own (before_after's --base, the GPU check's
    # --skip-pytest): never picked
    tools = [p.name for p in picked if {"--base", "--skip-pytest"} & _options(p)]
    assert tools == [] and (ROOT / "bench" / "tools" / "before_after.py").exists()
    # control: the check sees an option where one is declared, and not where none is
    assert "--base" in _options(ROOT / "bench" / "tools" / "before_after.py")
    assert "--skip-pytest" in _options(ROOT / "bench" / "tools" / "gpu_check.py")
    assert "--quick" not in _options(ROOT / "bench" / "run_all.py")


BENCH = ROOT / "bench"
MAX_LINES = 500


def _scripts() -> list[Path]:
    """Every Python file under bench/: benchmarks, tools, the suite, the library."""
    return sorted(p for p in BENCH.rglob("*.py") if "results" not in p.relative_to(BENCH).parts)


def _imported_modules(source: str) -> set[str]:
    """Every module a source imports, at the top or inside a function (``import a.b``,
    ``from a.b import c``: ``a.b``; a relative import: its module, dots dropped)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _bench_imports(source: str) -> set[str]:
    """The benchmark modules (``bench_*``, at any depth of the name) a source imports."""
    return {m for m in _imported_modules(source) if any(part.startswith("bench_") for part in m.split("."))}


def test_runner_picks_the_top_level_benchmarks_and_nothing_from_lib_or_tools() -> None:
    picked = _runner().benchmarks()
    assert picked == sorted(BENCH.glob("bench_*.py"))
    assert all(p.parent == BENCH for p in picked)
    assert not any(p.name.startswith("bench_") for p in (BENCH / "lib").rglob("*.py"))
    tools = sorted((BENCH / "tools").rglob("*.py"))
    assert not any(p.name.startswith("bench_") for p in tools)
    # control: the tools are there (the GPU check and its sections too), none of them picked
    assert {BENCH / "tools" / "gpu_check.py", BENCH / "tools" / "gpu" / "common.py"} <= set(tools)
    assert not set(tools) & set(picked)
    # bench/gpu_check.sh stays the GPU check's one command: it runs the tool where it is
    assert "python3 bench/tools/gpu_check.py " in (BENCH / "gpu_check.sh").read_text()


def test_no_benchmark_or_tool_imports_a_benchmark() -> None:
    """What benchmarks share lives in bench/lib/; a benchmark is a main, never a library."""
    scripts = _scripts()
    assert len(scripts) >= 30 and BENCH / "lib" / "servers.py" in scripts  # control: all of bench/ is read
    offenders = {str(p.relative_to(ROOT)): sorted(_bench_imports(p.read_text())) for p in scripts}
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}, f"benchmarks imported as libraries (move the shared part to bench/lib/): {offenders}"
    # controls: the check sees a benchmark imported at the top, inside a function, or from
    # a package, and lets the library and everything else through
    assert _bench_imports("import bench_serving as bs") == {"bench_serving"}
    assert _bench_imports("def f():\n    from bench_peer import first_line\n") == {"bench_peer"}
    assert _bench_imports("from bench.bench_disk import drop_caches") == {"bench.bench_disk"}
    assert _bench_imports("from lib import servers\nfrom lib.timing import drop_caches\nimport benchmark") == set()
    # the library is used: every benchmark that starts a server does it through lib
    users = [p.name for p in scripts if "lib" in {m.split(".")[0] for m in _imported_modules(p.read_text())}]
    assert len(users) >= 15, users


def test_only_a_benchmark_main_is_over_500_lines() -> None:
    """A file over 500 lines is a benchmark's own main (runs under ``__main__``), never
    a shared module: the library's modules stay small."""
    too_long = {p: len(p.read_text().splitlines()) for p in _scripts()}
    too_long = {p: n for p, n in too_long.items() if n > MAX_LINES}
    lib = {str(p.relative_to(ROOT)): n for p, n in too_long.items() if "lib" in p.relative_to(BENCH).parts}
    assert lib == {}, f"shared modules over {MAX_LINES} lines: {lib}"
    not_main = [str(p.relative_to(ROOT)) for p in too_long if 'if __name__ == "__main__":' not in p.read_text()]
    assert not_main == [], f"files over {MAX_LINES} lines that are no benchmark's main: {not_main}"


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
