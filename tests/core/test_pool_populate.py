"""The memory pool's pages faulted in on a background thread (``populate_pool``):
resident memory, untouched contents under concurrent writes, the engine's switch."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest
import torch

from lmcache_core import memory
from lmcache_core.config import load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import KeyNamespace
from lmcache_core.memory import MemoryPool
from lmcache_core.plugins import PluginManager

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux-only")

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def supported() -> bool:
    t = torch.empty(8 * PAGE, dtype=torch.uint8)
    return memory.populate(t)[1] is None


needs_populate = pytest.mark.skipif(not supported(), reason="kernel without MADV_POPULATE_WRITE (Linux < 5.14)")


@needs_populate
@pytest.mark.parametrize("populate", [True, False])
def test_populated_pool_is_resident_and_a_plain_one_is_not(populate: bool) -> None:
    before = rss()
    pool = MemoryPool(256 * MiB, populate=populate)
    assert pool.populated.wait(30)
    grown = rss() - before
    if populate:
        assert pool.populated_bytes >= 256 * MiB - 2 * PAGE
        assert grown >= 240 * MiB, f"resident memory grew by {grown / MiB:.0f} MiB only"
    else:  # the negative control: nothing touched the pages
        assert pool.populated_bytes == 0
        assert grown < 32 * MiB, f"resident memory grew by {grown / MiB:.0f} MiB without populate"


@needs_populate
def test_writes_while_the_pool_is_populated_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks written into the pool while the background thread faults it in keep
    their bytes (populate never writes)."""
    monkeypatch.setattr(memory, "POPULATE_STEP", 256 * 1024)  # many small steps: the writes land between them
    pool = MemoryPool(64 * MiB, populate=True)
    bufs = []
    for i in range(60):
        b = pool.allocate((MiB // 4,), torch.float32)
        assert b is not None
        b.tensor.fill_(float(i + 1))
        bufs.append(b)
    assert pool.populated.wait(30) and pool.populated_bytes >= 64 * MiB - 2 * PAGE
    for i, b in enumerate(bufs):
        assert torch.all(b.tensor == float(i + 1)), f"buffer {i} changed"


def test_stopped_populate_ends_early(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    stop.set()
    done, why = memory.populate(torch.empty(4 * MiB, dtype=torch.uint8), stop)
    assert (done, why) == (0, "stopped")


def test_unavailable_madvise_leaves_the_pool_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_madvise", lambda: None)
    pool = MemoryPool(4 * MiB, populate=True)
    assert pool.populated.wait(10) and pool.populated_bytes == 0
    b = pool.allocate((16,), torch.float32)
    assert b is not None


def _engine(**cfg: Any) -> CacheEngine:
    loaded = load_config(env={}, overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "64MiB"}], **cfg})
    return CacheEngine(
        loaded,
        namespace=KeyNamespace(model="populate-test", layout="test", dtype="float16"),
        plugins=PluginManager(load_entry_points=False),
    )


@needs_populate
def test_engine_populates_its_pool_only_when_told() -> None:
    with _engine(populate_pool=True) as eng:
        assert eng.pool.populated.wait(30)
        assert eng.stats()["pool"]["populated"] >= eng.pool.capacity - 2 * PAGE
    with _engine() as eng:  # the default: off
        assert eng.pool.populated.is_set() and eng.stats()["pool"]["populated"] == 0


def test_populate_runs_at_idle_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's populate thread never competes with the engine's threads for a core
    (SCHED_IDLE), while the thread that made the pool keeps its own policy."""
    seen: list[int] = []
    real = memory.populate

    def spy(data: torch.Tensor, *a: Any) -> tuple[int, str | None]:
        seen.append(os.sched_getscheduler(0))
        return real(data, *a)

    monkeypatch.setattr(memory, "populate", spy)
    pool = MemoryPool(4 * MiB, populate=True)
    assert pool.populated.wait(30)
    assert seen == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE
