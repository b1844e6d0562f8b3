"""``background_nice``: the engine's background threads (read-ahead, prefetch,
write-behind) and the connector's transfer queues run at the configured nice value
above the process's; 0 leaves them as they are (the negative control)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from lmcache_core.threads import lower_priority

from .test_engine import engine

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    return out[0]


def test_lower_priority_is_per_thread_and_capped() -> None:
    base = _own_nice()
    assert _in_thread(lambda: (lower_priority(3), _own_nice())[1]) == min(19, base + 3)
    assert _in_thread(lambda: (lower_priority(40), _own_nice())[1]) == 19
    assert _in_thread(lambda: (lower_priority(0), _own_nice())[1]) == base
    assert _own_nice() == base, "the caller's thread keeps its priority"


@pytest.mark.parametrize("nice", [0, 7])
def test_engine_background_threads_run_at_background_nice(nice: int) -> None:
    base = _own_nice()
    with engine(
        [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "local_cpu", "max_size": "1MiB"}], background_nice=nice
    ) as eng:
        assert eng._fetch_pool.submit(_own_nice).result(10) == min(19, base + nice)
        assert eng._prefetch_pool.submit(_own_nice).result(10) == min(19, base + nice)
        writer_tids = [t.native_id for w in eng._writers for t in w.threads]
        assert writer_tids
        deadline = time.monotonic() + 10
        want = min(19, base + nice)
        while time.monotonic() < deadline and any(os.getpriority(os.PRIO_PROCESS, t) != want for t in writer_tids if t):
            time.sleep(0.01)  # each writer thread lowers its own priority first thing
        assert all(t is not None and os.getpriority(os.PRIO_PROCESS, t) == want for t in writer_tids)


@pytest.mark.parametrize("nice", [0, 5])
def test_connector_transfer_queues_run_at_background_nice(nice: int) -> None:
    pytest.importorskip("vllm")
    from lmcache_connector.transfers.async_saves import SaveQueue

    q = SaveQueue(lambda t, meta: None, nice)
    try:
        tid = q._thread.native_id
        assert tid is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.getpriority(os.PRIO_PROCESS, tid) != min(19, _own_nice() + nice):
            time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, _own_nice() + nice)
    finally:
        q.close()
