"""The core knows its extensions only through hooks: no module or distribution name
of another distribution in this repository appears anywhere in ``lmcache_core/``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "lmcache_core"


def extension_names() -> set[str]:
    """Top-level packages and distribution names of every other distribution here."""
    names: set[str] = set()
    for pyproject in ROOT.glob("**/pyproject.toml"):
        if pyproject.parent == ROOT or ".venv" in pyproject.parts or ".tox" in pyproject.parts:
            continue
        meta = tomllib.loads(pyproject.read_text())
        names.add(meta["project"]["name"])
        for init in pyproject.parent.glob("**/__init__.py"):
            pkg = init.parent
            if (pkg.parent / "__init__.py").exists() or pkg.name in ("tests", "csrc"):
                continue
            names.add(pkg.name)
    return names


def mentions(tree: Path, names: set[str]) -> list[str]:
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\b")
    found = []
    for path in sorted(tree.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_the_names_cover_every_extension() -> None:
    names = extension_names()
    expected = {"lmcache_connector", "lmcache_cuda", "lmcache-connector-vllm", "lmcache-cuda", "lmcache_backend_example"}
    expected |= {f"lmcache_backend_{b}" for b in ("disk", "s3", "peer", "redis", "mooncake")}
    assert expected <= names, expected - names


def test_core_names_no_extension() -> None:
    assert mentions(CORE, extension_names()) == []


def test_the_scan_finds_names_where_they_are() -> None:
    """Negative control: the same scan over the connector finds the connector's own names."""
    assert any("lmcache_connector" in hit for hit in mentions(ROOT / "connector", extension_names()))
