"""Structural bars the core keeps, checked on its source (AST), not by importing it:

* no import cycle among ``lmcache_core`` modules: every import counts, those under
  ``if TYPE_CHECKING:`` and inside functions included (a cycle hidden in a function
  is still two modules that cannot be understood apart);
* no function in ``lmcache_core/`` or the connector is longer than
  :data:`MAX_FUNCTION_LINES` lines;
* no private name crosses a module: ``obj._name`` only where the module defines
  ``_name`` itself, and no ``from X import _name``;
* ``CacheEngine`` (the engine's heart) stays within :data:`MAX_ENGINE_LINES` lines and
  the disk tier's coordinator ``DiskBackend`` within :data:`MAX_DISK_BACKEND_LINES`.

Each bar has a negative control, so a checker that finds nothing is caught."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "lmcache_core"
CONNECTOR = ROOT / "connector" / "lmcache_connector"
MAX_FUNCTION_LINES = 60
MAX_ENGINE_LINES = 350
MAX_DISK_BACKEND_LINES = 450
#: public methods that start with an underscore (``NamedTuple``'s, by design)
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make"}

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    """``lmcache_core/serde.py`` -> ``lmcache_core.serde``; a package's ``__init__.py``
    is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path) -> dict[str, Path]:
    """Every module of ``package`` by dotted name."""
    return {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, here: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` an import statement in module ``here`` names: ``import
    X``, ``X``; ``from X import a``, ``X.a`` where that is a module, else ``X``.
    Relative imports are resolved against ``here``. (Importing ``X.a`` also runs
    ``X/__init__``: that implicit edge is not counted, as Python's own import order
    makes it harmless.)"""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & known
    base = node.module or ""
    if node.level:
        parts = here.split(".") if is_package else here.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names} & known


def import_graph(package: Path) -> Graph:
    """``{module: modules of package it imports}``, every import statement counted."""
    known = modules(package)
    graph: Graph = {}
    for name, path in known.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= imported(node, name, path.name == "__init__.py", set(known))
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or ``None``: a depth-first
    search that reports the first edge back to a module still on its path."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def long_functions(package: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` for each function or method of ``package`` longer
    than ``limit`` lines (decorators excluded, docstring included)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def private_crossings(package: Path) -> list[str]:
    """``path:line expr`` for each ``obj._name`` (``obj`` not ``self``/``cls``) whose
    module does not itself define ``_name`` (a def, class, assignment or argument),
    and each ``from X import _name``: a private name used across modules."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        defined: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
        rel = path.relative_to(package.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if node.attr in PUBLIC_UNDERSCORED:
                    continue
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if node.attr not in defined:
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{rel}:{node.lineno} from {node.module} import {alias.name}")
    return found


def class_lines(path: Path, name: str) -> int:
    """The lines of class ``name`` in ``path`` (from ``class`` to its last line)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return (node.end_lineno or node.lineno) - node.lineno + 1
    raise AssertionError(f"{path}: no class {name}")


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# -- no import cycle ------------------------------------------------------------------


def test_the_graph_sees_the_core() -> None:
    graph = import_graph(CORE)
    assert {"lmcache_core.engine", "lmcache_core.serde", "lmcache_core.testing.memory"} <= set(graph)
    assert "lmcache_core.keys" in graph["lmcache_core.serde"]


def test_no_import_cycle_among_core_modules() -> None:
    assert find_cycle(import_graph(CORE)) is None


def test_the_detector_finds_a_cycle() -> None:
    """Negative control: a three-module loop is found, a diamond is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None


def test_type_only_function_and_relative_imports_are_edges(tmp_path: Path) -> None:
    """Negative control on real files: a cycle closed only by an import under
    ``TYPE_CHECKING``, or only by one inside a function, or through ``from . import``
    of a subpackage's module, is still a cycle."""
    pkg = (
        write(
            tmp_path,
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from typing import TYPE_CHECKING\nfrom .b import x\nif TYPE_CHECKING:\n    from .c import y\n",
                "pkg/b.py": "def f():\n    from . import c\n",
                "pkg/c.py": "from .sub import d\n",
                "pkg/sub/__init__.py": "",
                "pkg/sub/d.py": "from .. import a\n",
            },
        )
        / "pkg"
    )
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.sub.d"} and graph["pkg.sub.d"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.a"]


# -- no long function -----------------------------------------------------------------


def test_no_function_in_the_core_is_over_the_limit() -> None:
    assert long_functions(CORE) == []


def test_no_function_in_the_connector_is_over_the_limit() -> None:
    assert long_functions(CONNECTOR) == []


def test_the_length_check_finds_a_long_function(tmp_path: Path) -> None:
    """Negative control: a method of 61 lines is reported, one of 60 is not."""
    body = "\n".join(f"        x{i} = {i}" for i in range(59))
    pkg = write(tmp_path, {"pkg/m.py": f"class C:\n    def long(self):\n{body}\n        return 0\n\n    def ok(self):\n{body}\n"})
    pkg = pkg / "pkg"
    assert long_functions(pkg) == ["pkg/m.py:2 long (61 lines)"]


# -- no private name across modules ---------------------------------------------------


def test_no_private_name_crosses_a_module() -> None:
    assert private_crossings(CORE) + private_crossings(CONNECTOR) == []


def test_the_private_check_finds_a_crossing(tmp_path: Path) -> None:
    """Negative control: another module's ``obj._x`` and ``from m import _f`` are
    found; the module's own ``other._x`` (it defines ``_x``) and ``self._y`` are not."""
    pkg = write(
        tmp_path,
        {
            "pkg/m.py": "def _f():\n    pass\n\n\nclass A:\n    def __init__(self):\n        self._x = 1\n\n    def same(self, other):\n        return other._x + self._y\n",
            "pkg/n.py": "from .m import _f\n\n\ndef g(a):\n    return a._x\n",
        },
    )
    assert private_crossings(pkg / "pkg") == ["pkg/n.py:1 from m import _f", "pkg/n.py:5 a._x"]


# -- the heart stays small ------------------------------------------------------------


def test_the_engine_and_the_disk_coordinator_stay_small() -> None:
    engine = class_lines(CORE / "engine.py", "CacheEngine")
    disk = class_lines(ROOT / "backends" / "disk" / "lmcache_backend_disk" / "backend.py", "DiskBackend")
    assert engine <= MAX_ENGINE_LINES, f"CacheEngine is {engine} lines"
    assert disk <= MAX_DISK_BACKEND_LINES, f"DiskBackend is {disk} lines"
    assert class_lines(CORE / "pins.py", "PinBook") > 10  # control: the counter reads classes


# -- the map of record lists every module -----------------------------------------------


def unlisted_modules(doc: str, packages: list[Path]) -> list[str]:
    """Modules (``__init__.py`` aside) of ``packages`` whose file name ``doc`` never
    mentions."""
    return [
        str(p.relative_to(ROOT))
        for pkg in packages
        for p in sorted(pkg.rglob("*.py"))
        if p.name != "__init__.py" and p.name not in doc
    ]


def test_architecture_md_lists_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert unlisted_modules(doc, [CORE, CONNECTOR]) == []
    assert unlisted_modules(doc.replace("pins.py", ""), [CORE]) == ["lmcache_core/pins.py"]  # control
