"""``connector.async_loads: true`` on real vLLM (CPU): hits answered with ``load_kv_async=True``,
loaded on the worker's load thread while the request waits in vLLM's
``WAITING_FOR_REMOTE_KVS``, reported through ``finished_recving``. Outputs stay
token-identical to vLLM without a connector; a failed load is recomputed (the part
that loaded is kept); an abort while the load is in flight leaks neither vLLM's
blocks nor the cache's pins."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest
from lmcache_core.plugins import get_plugin_manager

from lmcache_connector.transfer_config import tokens_prompt

from .conftest import greedy, make_llm, random_prompt, run, token_ids, worker
from .plugins_for_tests import FlakyPlugin

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CS = 256
ASYNC = {"connector": {"async_loads": True}}


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _free_blocks(llm: Any) -> tuple[int, int]:
    pool = _scheduler(llm).kv_cache_manager.block_pool
    return pool.get_num_free_blocks(), pool.num_gpu_blocks


@pytest.fixture
def remote_kv_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Requests vLLM moved out of WAITING_FOR_REMOTE_KVS (its own async-load path),
    with the tokens it then counted as computed."""
    from vllm.v1.core.sched.scheduler import Scheduler

    seen: list[tuple[str, int]] = []
    orig = Scheduler._update_waiting_for_remote_kv

    def count(self: Any, request: Any) -> None:
        orig(self, request)
        seen.append((request.request_id, request.num_computed_tokens))

    monkeypatch.setattr(Scheduler, "_update_waiting_for_remote_kv", count)
    yield seen


def test_async_loads_token_identical_and_really_async(tiny_model, reference, remote_kv_waits):
    prefixes = [random_prompt(3 * CS, 600 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + random_prompt(40 + 7 * i, 610 + i) for i in range(6)]
    ref = reference(prompts)
    with make_llm(tiny_model, max_num_batched_tokens=1024, extra=ASYNC) as llm:
        w = worker()
        assert w.loads is not None
        assert token_ids(run(llm, prompts)) == ref
        waits_cold = len(remote_kv_waits)
        warm = run(llm, prompts)
        assert token_ids(warm) == ref
        assert all(o.num_cached_tokens == 3 * CS for o in warm)
        # the loads went through vLLM's WAITING_FOR_REMOTE_KVS and the load thread
        assert len(remote_kv_waits) - waits_cold >= 6
        assert w.loads.submitted >= 6 and w.loads.completed == w.loads.submitted
        assert w.stats()["loaded_tokens"] >= 6 * 3 * CS
        assert _scheduler(llm).connector._sched.async_load_requests >= 6
        assert w.engine.pins.ids() == set()
        run(llm, [random_prompt(20, 620)])
        free, total = _free_blocks(llm)
        assert free == total - 1  # all but vLLM's null block
    # negative control: the same run without the switch loads synchronously
    remote_kv_waits.clear()
    with make_llm(tiny_model, max_num_batched_tokens=1024) as llm:
        run(llm, prompts)
        warm = run(llm, prompts)
        assert token_ids(warm) == ref
        assert all(o.num_cached_tokens == 3 * CS for o in warm)
        # (the default, auto, loads in the background only what a slower tier than memory serves)
        assert worker().stats()["async_loads"] == 0
        assert remote_kv_waits == []


def test_failed_async_load_recomputes(tiny_model, reference):
    """Every read corrupt: each load fails from its first chunk, vLLM frees the blocks,
    asks again and the connector offers no hit: recomputed, token-identical."""
    prompts = [random_prompt(800, 631), random_prompt(900, 632)]
    later = [random_prompt(600, 633)]
    ref = reference(prompts + later)
    with get_plugin_manager().registered(FlakyPlugin(), name="test-flaky-async"):
        extra = {**ASYNC, "backends": [{"name": "flaky", "mode": "corrupt"}]}
        with make_llm(tiny_model, extra=extra) as llm:
            run(llm, prompts)
            warm = run(llm, prompts)
            assert token_ids(warm) == ref[:2]
            assert [o.num_cached_tokens for o in warm] == [0, 0]
            w = worker()
            assert w.loads.submitted >= 2 and w.loads.failed >= 2
            assert w.stats()["failed_loads"] >= 2
            assert w.engine.tiers[0].stats().extra["corrupt_reads"] >= 2
            assert token_ids(run(llm, later)) == ref[2:]


def test_removed_chunk_keeps_the_loaded_prefix(tiny_model, reference, monkeypatch, remote_kv_waits):
    """The third chunk of the hit disappears from the CPU tier between the lookup and
    the load: the first two load, vLLM recomputes from there, tokens identical."""
    p = random_prompt(4 * CS + 30, 641)
    ref = reference([p])
    with make_llm(tiny_model, extra=ASYNC) as llm:
        run(llm, [p])
        w = worker()
        orig = w.transfers.load
        removed: list[bool] = []

        def remove_then_load(t: Any, meta: Any) -> set[int]:
            removed.append(w.engine.tiers[0].remove(w.engine.namespace.key(t.hashes[2])))
            for kv in w.layout.layers:  # the request's blocks may still hold this prompt's KV: make them wrong
                kv[t.block_ids] = 3.0
            return orig(t, meta)

        monkeypatch.setattr(w.transfers, "load", remove_then_load)
        before = w.stats()["loaded_tokens"]
        out = run(llm, [p])
        assert removed == [True]
        assert token_ids(out) == ref
        assert w.stats()["loaded_tokens"] - before == 2 * CS
        assert [n for _, n in remote_kv_waits] == [2 * CS]  # vLLM kept the prefix that loaded
        assert w.stats()["failed_loads"] == 1 and w.loads.failed == 1
        assert w.engine.pins.ids() == set()


def test_abort_during_async_load(tiny_model, reference, monkeypatch):
    """A request aborted while the load thread is inside its load: vLLM keeps its
    blocks until the load is reported, then every block and every pin goes back."""
    p = random_prompt(3 * CS + 20, 651)
    q = random_prompt(500, 652)
    ref = reference([p, q])
    with make_llm(tiny_model, extra=ASYNC) as llm:
        run(llm, [p])
        w = worker()
        gate, entered = threading.Event(), threading.Event()
        orig = w.transfers.load

        def held(t: Any, meta: Any) -> set[int]:
            entered.set()
            assert gate.wait(30)
            return orig(t, meta)

        monkeypatch.setattr(w.transfers, "load", held)
        eng = llm.llm_engine
        eng.add_request("abort-me", tokens_prompt(p), greedy())
        deadline = time.monotonic() + 30
        while not entered.is_set():
            assert time.monotonic() < deadline, "the load never reached the load thread"
            eng.step()
        assert w.engine.pins.ids()  # the hit is pinned while its load is in flight
        eng.abort_request(["abort-me"])
        for _ in range(3):
            eng.step()  # steps while the load is still held: no crash
        assert not eng.has_unfinished_requests()
        gate.set()
        w.loads.drain()
        monkeypatch.setattr(w.transfers, "load", orig)
        # later requests run normally; the aborted request's blocks come back
        assert token_ids(run(llm, [q])) == ref[1:]
        assert token_ids(run(llm, [p])) == ref[:1]
        run(llm, [random_prompt(20, 653)])
        free, total = _free_blocks(llm)
        assert free == total - 1
        assert w.engine.pins.ids() == set()
        assert w.loads.completed == w.loads.submitted


def test_auto_loads_slow_tier_hits_in_the_background_and_memory_hits_in_step(tiny_model, reference, remote_kv_waits, tmp_path):
    """async_loads: auto (the default): the first hit served from the disk tier (never
    read yet: its speed unknown) goes through WAITING_FOR_REMOTE_KVS and the load
    thread (later ones follow the tier's measured speed: a disk in the page cache reads
    these chunks in well under 5 ms, so they load in the step); the same prompts
    again, now promoted to the CPU tier, all load in the step."""
    prompts = [random_prompt(3 * CS + 30, 650 + i) for i in range(3)]
    ref = reference(prompts)
    tiers = {
        "backends": [
            {"name": "local_cpu", "max_size": "256MiB"},
            {"name": "disk", "path": str(tmp_path / "d"), "max_size": "1GiB"},
        ]
    }
    with make_llm(tiny_model, max_num_batched_tokens=1024, extra=tiers) as llm:
        run(llm, prompts)
        worker().engine.flush(30)  # everything on disk too
    remote_kv_waits.clear()
    with make_llm(tiny_model, max_num_batched_tokens=1024, extra=tiers) as llm:  # empty CPU tier
        w = worker()
        warm = run(llm, prompts)
        assert token_ids(warm) == ref and all(o.num_cached_tokens == 3 * CS for o in warm)
        assert len(remote_kv_waits) >= 1 and w.loads.submitted >= 1, "the first disk hit was not loaded in the background"
        before, waits = w.loads.submitted, len(remote_kv_waits)
        again = run(llm, prompts)
        assert token_ids(again) == ref and all(o.num_cached_tokens == 3 * CS for o in again)
        assert w.loads.submitted == before and len(remote_kv_waits) == waits, "memory hits left the step"
