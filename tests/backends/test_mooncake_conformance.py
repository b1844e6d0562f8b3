"""The mooncake tier runs the backend conformance suite against a real Mooncake Store
(``mooncake_master`` and a segment owner from the wheel, on loopback), with raw and
lz4 frames; ``persistent``: a second client of the same store sees the data.

Closing a Mooncake client takes about a second (its threads wind down), so the
per-test ``backend`` fixture shares one tier per class; ``make_backend`` still builds
a fresh one where the suite asks for it (close, persistence)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mooncake_server import MooncakeMaster, mooncake_store  # noqa: E402,F401 - fixture

from lmcache_backend_mooncake import create_mooncake_backend  # noqa: E402
from lmcache_core.backend import BackendContext, StorageBackend  # noqa: E402
from lmcache_core.testing import BackendConformance  # noqa: E402


class TestMooncakeConformance(BackendConformance):
    persistent = True

    @pytest.fixture(autouse=True)
    def _store(self, mooncake_store: MooncakeMaster) -> None:
        self.store = mooncake_store

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_mooncake_backend(self.store.options(key_prefix=f"conf/{tmp_path.name}/", staging_size="16MiB"), ctx)

    @pytest.fixture(scope="class")
    @classmethod
    def _shared(cls, mooncake_store: MooncakeMaster) -> Iterator[dict[str, Any]]:
        holder: dict[str, Any] = {}
        yield holder
        if "backend" in holder:
            holder["backend"].close()

    @pytest.fixture
    def backend(self, ctx: BackendContext, tmp_path: Path, _shared: dict[str, Any]) -> Any:
        if "backend" not in _shared:
            _shared["backend"] = self.make_backend(ctx, tmp_path)
        yield _shared["backend"]


class TestMooncakeConformanceLz4(TestMooncakeConformance):
    codec = "lz4"
