"""Every distribution in the repository declares exactly what it imports: no
third-party import is missing from its dependencies, no dependency goes unimported
(each exception below says why), plugins pin a compatible lmcache-core range, each
ships py.typed, and the core's version has one source."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTS = sorted(p.parent for p in ROOT.glob("**/pyproject.toml") if ".venv" not in p.parts and ".tox" not in p.parts)

# distribution name -> the module it installs, where they differ
IMPORT_NAME = {"pyyaml": "yaml", "pyzmq": "zmq", "prometheus-client": "prometheus_client"}
# imported but deliberately not required, per distribution
OPTIONAL_IMPORTS = {
    "lmcache-connector-vllm": {"vllm", "lmcache_cuda"},  # install the vLLM build for your hardware; CUDA kernels when present
    "lmcache-backend-mooncake": {"mooncake"},  # one of several client builds: extras cpu / cuda
    "lmcache-core": {"pytest"},  # lmcache_core.testing only: extra "testing"
    "lmcache-cuda": {"lmcache_core"},  # lmcache_cuda.fp8 only: the fp8 frame is lmcache_core's codec
}
# required but not imported, per distribution
NOT_IMPORTED = {"lmcache-cuda": {"ninja"}}  # torch.utils.cpp_extension runs it for the JIT build


def _meta(dist: Path) -> dict:
    return tomllib.loads((dist / "pyproject.toml").read_text())


def _packages(dist: Path) -> list[Path]:
    out = []
    for init in dist.glob("**/__init__.py"):
        if ".venv" in init.parts or "tests" in init.parts or any(p.name == "csrc" for p in init.parents):
            continue
        if not (init.parent.parent / "__init__.py").exists():
            if dist == ROOT and init.parent.name != "lmcache_core":
                continue
            out.append(init.parent)
    return out


def _imports(dist: Path) -> set[str]:
    mods = set()
    for pkg in _packages(dist):
        for path in pkg.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    mods.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods.add(node.module.split(".")[0])
    own = {p.name for p in _packages(dist)}
    return {m for m in mods if m not in sys.stdlib_module_names and m not in own}


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower()


def _declared(meta: dict) -> set[str]:
    return {_requirement_name(r) for r in meta["project"].get("dependencies", [])}


@pytest.mark.parametrize("dist", DISTS, ids=[str(d.relative_to(ROOT)) or "core" for d in DISTS])
def test_dependencies_are_what_the_code_imports(dist: Path) -> None:
    meta = _meta(dist)
    name = meta["project"]["name"]
    declared = {IMPORT_NAME.get(d, d.replace("-", "_")) for d in _declared(meta)}
    imported = _imports(dist)
    assert imported, f"{name}: found no imports (is the package layout still {_packages(dist)}?)"
    repo_dists = {IMPORT_NAME.get(n, n.replace("-", "_")) for n in ("lmcache-core",)}
    missing = imported - declared - OPTIONAL_IMPORTS.get(name, set())
    unused = declared - imported - {n.replace("-", "_") for n in NOT_IMPORTED.get(name, set())} - repo_dists
    assert missing == set(), f"{name} imports {sorted(missing)} without declaring them"
    assert unused == set(), f"{name} requires {sorted(unused)} but never imports them"


@pytest.mark.parametrize("dist", [d for d in DISTS if d != ROOT], ids=lambda d: str(d.relative_to(ROOT)))
def test_plugins_pin_a_compatible_core_range(dist: Path) -> None:
    meta = _meta(dist)
    core = [r for r in meta["project"]["dependencies"] if _requirement_name(r) == "lmcache-core"]
    if meta["project"]["name"] == "lmcache-cuda":
        assert core == []  # standalone kernels, usable without the core
        return
    assert core == ["lmcache-core>=0.1,<0.2"]


@pytest.mark.parametrize("dist", DISTS, ids=[str(d.relative_to(ROOT)) or "core" for d in DISTS])
def test_each_package_ships_py_typed(dist: Path) -> None:
    text = (dist / "pyproject.toml").read_text()
    for pkg in _packages(dist):
        assert (pkg / "py.typed").is_file(), pkg
        assert re.search(rf'^{pkg.name} = \[[^\]]*"py.typed"', text, re.M), f"{dist}: package-data lacks py.typed"


def test_the_core_version_has_one_source() -> None:
    import importlib.metadata as md

    import lmcache_core

    meta = _meta(ROOT)
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lmcache_core.__version__"}
    assert md.version("lmcache-core") == lmcache_core.__version__
