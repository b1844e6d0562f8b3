"""Real components the core tests share: an in-memory tier and fake-but-real
installed distributions (dist-info directories on sys.path)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from lmcache_core.backend import BackendContext, BackendStats, StorageBackend, prefix_count
from lmcache_core.hookspecs import RegisterBackend, hookimpl
from lmcache_core.keys import ChunkKey


class DictTier(StorageBackend):
    """A plain in-memory tier holding tensor copies. ``gate`` (an Event) makes ``put``
    wait until it is set: a tier that is slow for as long as a test wants."""

    name = "dict_tier"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.data: dict[ChunkKey, torch.Tensor] = {}
        self.gate = gate
        self.puts = 0
        self._lock = threading.Lock()

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return prefix_count(keys, self.data)

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        if self.gate is not None:
            self.gate.wait()
        with self._lock:
            self.data[key] = data.clone()
            self.puts += 1
        return True

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        with self._lock:
            t = self.data.get(key)
        if t is None or t.shape != out.shape or t.dtype != out.dtype:
            return False
        out.copy_(t)
        return True

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            return self.data.pop(key, None) is not None

    def stats(self) -> BackendStats:
        with self._lock:
            return BackendStats(self.name, chunks=len(self.data), puts=self.puts)


class BrokenTier(StorageBackend):
    """Raises on every call, as a tier whose server is down would."""

    name = "broken"

    def _fail(self, *args: Any) -> Any:
        raise ConnectionError("backend is down")

    contains = put = get = remove = stats = close = _fail  # type: ignore[assignment]


class TierPlugin:
    """A plugin registering ``dict_tier`` and ``broken``; keeps what it built."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.created: list[StorageBackend] = []

    def _make(self, cls: Callable[[], StorageBackend]) -> Callable[[Mapping[str, Any], BackendContext], StorageBackend]:
        def factory(section: Mapping[str, Any], ctx: BackendContext) -> StorageBackend:
            backend = cls()
            self.created.append(backend)
            return backend

        return factory

    @hookimpl
    def register_backends(self, register: RegisterBackend) -> None:
        register("dict_tier", self._make(lambda: DictTier(self.gate)))
        register("broken", self._make(BrokenTier))


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
