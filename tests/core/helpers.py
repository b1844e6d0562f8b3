"""Real components the core tests share: the reference in-memory tier registered as
``dict_tier`` and ``broken``, and fake-but-real installed distributions (dist-info
directories on sys.path)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from lmcache_core.backend import BackendContext, StorageBackend
from lmcache_core.hookspecs import RegisterBackend, hookimpl
from lmcache_core.testing import MemoryTier


class TierPlugin:
    """A plugin registering two reference tiers (:class:`MemoryTier`): ``dict_tier``,
    whose writes wait for ``gate`` when given (a tier as slow as a test wants), and
    ``broken``, which raises from every call (a tier whose server is down); keeps
    what it built."""

    def __init__(self, gate: threading.Event | None = None, factory: type[MemoryTier] = MemoryTier) -> None:
        """``factory``: the class ``dict_tier`` is made of (a subclass that counts calls)."""
        self.gate = gate
        self.factory = factory
        self.created: list[StorageBackend] = []

    def _make(self, cls: Callable[[], StorageBackend]) -> Callable[[Mapping[str, Any], BackendContext], StorageBackend]:
        def factory(section: Mapping[str, Any], ctx: BackendContext) -> StorageBackend:
            backend = cls()
            self.created.append(backend)
            return backend

        return factory

    @hookimpl
    def register_backends(self, register: RegisterBackend) -> None:
        register("dict_tier", self._make(lambda: self.factory(name="dict_tier", put_gate=self.gate)))
        register("broken", self._make(lambda: MemoryTier(name="broken", down=True)))


def make_distribution(root: Path, dist: str, version: str, entry_points: Mapping[str, str], modules: Mapping[str, str]) -> None:
    """Install a distribution the way pip lays it out: a dist-info directory with
    METADATA and entry_points.txt, and its modules, all under ``root``."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[lmcache_core.backends]\n{eps}")
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(src)


GOOD_PLUGIN_SRC = """
from lmcache_core.hookspecs import hookimpl

@hookimpl
def register_backends(register):
    from lmcache_backend_example import create_dict_backend
    register("{backend}", create_dict_backend, description="from a tmp distribution")
"""

BROKEN_PLUGIN_SRC = """
import pathlib
with open(pathlib.Path(__file__).with_suffix(".imports"), "a") as f:
    f.write("import\\n")
raise RuntimeError("this plugin is broken on purpose")
"""
