"""A real Mooncake Store on loopback for the mooncake tier's tests: the master and a
segment owner from the client wheel (:mod:`lmcache_backend_mooncake.local`). When the
wheel or its system libraries are missing, the tests skip with what to install (CI
installs them, see .ci/run)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from lmcache_backend_mooncake.local import LocalMaster, LocalSegmentOwner


def require_mooncake() -> None:
    """Skip, saying what to install, when the client cannot load."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as err:
        pytest.skip(
            f"Mooncake client cannot load ({err}): pip install mooncake-transfer-engine-non-cuda "
            "and apt-get install libibverbs1 librdmacm1 (as requirements-dev.txt and .ci/run do)"
        )


class MooncakeMaster(LocalMaster):
    def __init__(self, workdir: Path, **kw: int) -> None:
        require_mooncake()
        super().__init__(workdir, **kw)


SegmentOwner = LocalSegmentOwner


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master plus one 256 MiB segment owner for the session."""
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    owner = SegmentOwner(master)
    try:
        yield master
    finally:
        owner.kill()
        master.kill()


@pytest.fixture
def fresh_store(tmp_path: Path) -> Iterator[tuple[MooncakeMaster, LocalSegmentOwner]]:
    """A master and a 64 MiB segment owner of its own, for tests that kill them."""
    master = MooncakeMaster(tmp_path)
    owner = SegmentOwner(master, size_mib=64)
    try:
        yield master, owner
    finally:
        owner.kill()
        master.kill()
