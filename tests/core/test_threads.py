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

from lmcache_core import threads as threads_mod
from lmcache_core.config import ConfigError, CoreConfig
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


def _on_prefetch_thread(eng: Any, fn: Any) -> Any:
    """``fn()``'s result, called on the engine's prefetch thread (as a prefetch's read)."""
    out: list[Any] = []
    done = threading.Event()

    def read() -> Any:
        out.append(fn())
        done.set()
        yield None

    assert eng.prefetcher.start(b"probe", 0, read)
    assert done.wait(10)
    return out[0]


@pytest.mark.parametrize("nice", [0, 7])
def test_engine_background_threads_run_at_background_nice(nice: int) -> None:
    base = _own_nice()
    with engine(
        [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "local_cpu", "max_size": "1MiB"}], background_nice=nice
    ) as eng:
        assert eng.fetch_pool.submit(_own_nice).result(10) == min(19, base + nice)
        assert _on_prefetch_thread(eng, _own_nice) == min(19, base + nice)
        writer_tids = [t.native_id for w in eng.stack.writers for t in w.threads]
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


# -- background_cores ------------------------------------------------------------------

HOST_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(HOST_CORES) < 2, reason="needs 2 cores to move a thread to one of them")


@pytest.fixture
def no_background_cores() -> Any:
    threads_mod.use_background_cores(None)
    yield
    threads_mod.use_background_cores(None)


def _thread_cores(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


def test_spare_cores_are_the_ones_the_model_is_not_bound_to() -> None:
    assert threads_mod.spare_cores({0, 1, 2, 3}, {1}) == {0, 2, 3}
    # negative controls: a model bound to every core, or not a part of the machine, leaves nothing to move to
    assert threads_mod.spare_cores({0, 1}, {0, 1}) is None
    assert threads_mod.spare_cores({0, 1}, set()) is None
    assert threads_mod.spare_cores({0, 1}, {2}) is None


@needs_two_cores
def test_enter_background_moves_only_the_calling_thread(no_background_cores: None) -> None:
    mine = os.sched_getaffinity(0)
    threads_mod.use_background_cores({HOST_CORES[0]})
    assert _in_thread(lambda: (threads_mod.enter_background(0), os.sched_getaffinity(0))[1]) == {HOST_CORES[0]}
    assert os.sched_getaffinity(0) == mine, "the caller's thread keeps its cores"
    threads_mod.use_background_cores(None)  # the negative control: unset, a thread stays where it starts
    assert _in_thread(lambda: (threads_mod.enter_background(0), os.sched_getaffinity(0))[1]) == mine


@needs_two_cores
@pytest.mark.parametrize("cores", ["list", "none"])
def test_engine_background_threads_run_on_background_cores(cores: str, no_background_cores: None) -> None:
    want = {HOST_CORES[-1]} if cores == "list" else os.sched_getaffinity(0)
    value: Any = [HOST_CORES[-1]] if cores == "list" else "none"
    with engine(
        [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "local_cpu", "max_size": "1MiB"}], background_cores=value
    ) as eng:
        assert eng.fetch_pool.submit(os.sched_getaffinity, 0).result(10) == want
        assert _on_prefetch_thread(eng, lambda: os.sched_getaffinity(0)) == want
        writer_tids = [t.native_id for w in eng.stack.writers for t in w.threads]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(t and _thread_cores(t) != want for t in writer_tids):
            time.sleep(0.01)
        assert writer_tids and all(t is not None and _thread_cores(t) == want for t in writer_tids)


def test_background_cores_config_is_checked() -> None:
    assert CoreConfig().background_cores == "none"
    assert CoreConfig(background_cores="auto").background_cores == "auto"
    assert CoreConfig(background_cores=[0, 1]).background_cores == [0, 1]
    for bad in ([], [-1], "some", 3):
        with pytest.raises((ConfigError, ValueError)):
            CoreConfig(background_cores=bad)


@needs_two_cores
def test_connector_picks_the_cores_the_model_is_not_bound_to(no_background_cores: None) -> None:
    pytest.importorskip("vllm")
    from lmcache_connector.features.cpu_cores import background_cores

    def bound_like_vllm_cpu() -> Any:
        os.sched_setaffinity(0, {HOST_CORES[-1]})  # what vLLM-CPU's OpenMP binding does to the model's thread
        return (
            background_cores(1, cpu_platform=True),
            background_cores(2, cpu_platform=True),
            background_cores(1, cpu_platform=False),
        )

    one_rank, two_ranks, gpu = _in_thread(bound_like_vllm_cpu)
    assert one_rank == set(os.sched_getaffinity(os.getppid())) - {HOST_CORES[-1]}
    assert two_ranks is None and gpu is None
    # negative control: a model thread bound to every core leaves the threads where they start
    if os.sched_getaffinity(0) == os.sched_getaffinity(os.getppid()):
        assert background_cores(1, cpu_platform=True) is None
