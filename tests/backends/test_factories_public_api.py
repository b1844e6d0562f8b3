"""A tier's factory builds and checks its backend through the backend's public API
only (the Redis and S3 start-up checks record an unreachable server with
``mark_unavailable`` / ``mark_available``), so the backend class can change its
internals without breaking its factory. Checked on the factories' source: no access
to another object's ``_private`` attribute."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = sorted(ROOT.glob("backends/*/lmcache_backend_*/factory.py"))


def private_uses(source: str) -> list[str]:
    """``obj._name`` accesses in ``source`` where ``obj`` is not ``self``/``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
            if owner not in ("self", "cls"):
                found.append(f"line {node.lineno}: {owner}.{node.attr}")
    return found


def test_the_check_finds_a_private_call() -> None:
    """Negative control: the check sees what the Redis factory used to do."""
    assert private_uses('def _verify(backend):\n    backend._failed("startup check", err)\n    backend._ok()\n') == [
        "line 2: backend._failed",
        "line 3: backend._ok",
    ]
    assert private_uses("def f(self):\n    self._ok()\n") == []


@pytest.mark.parametrize("path", FACTORIES, ids=[p.parent.parent.name for p in FACTORIES])
def test_factories_use_only_public_backend_api(path: Path) -> None:
    assert private_uses(path.read_text()) == []


def test_every_remote_factory_is_checked() -> None:
    assert {p.parent.parent.name for p in FACTORIES} >= {"redis", "s3", "peer", "mooncake"}
