"""``connector.async_saves: true`` on real vLLM (CPU): saves run in the background, vLLM holds
a finished request's blocks until its saves are reported done, and a preemption
makes the worker finish saves before the freed blocks are written again. Outputs
stay token-identical, hits are served, and every block goes back to vLLM."""

from __future__ import annotations

import pytest

from .conftest import greedy, make_llm, random_prompt, run, scheduler_side, token_ids, worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CS = 256


def _free_blocks(llm) -> tuple[int, int]:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks(), pool.num_gpu_blocks


def test_background_saves_hit_and_give_every_block_back(tiny_model, reference):
    prefixes = [random_prompt(2 * CS, 500 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + random_prompt(50 + 9 * i, 510 + i) for i in range(9)]
    ref = reference(prompts)
    with make_llm(tiny_model, max_num_batched_tokens=1024, extra={"connector": {"async_saves": True}}) as llm:
        w = worker()
        assert w.saves is not None
        assert token_ids(run(llm, prompts)) == ref
        w.saves.drain()
        warm = run(llm, prompts)
        assert token_ids(warm) == ref
        assert all(o.num_cached_tokens == 2 * CS for o in warm)
        run(llm, [random_prompt(20, 520)])  # one more step collects the last finished_sending
        w.saves.drain()
        run(llm, [random_prompt(20, 521)])
        free, total = _free_blocks(llm)
        assert free == total - 1  # all but vLLM's null block
        # requests that saved in the background were held until done, and exactly those
        # were reported (one per prefix at least: later ones may hit what it saved)
        sched = scheduler_side(llm)
        assert sched.held_requests + sched.freed_early >= 3
        assert w.saves.reported == sched.held_requests
        assert not w.saves._seen and not w.saves._pending and not w.saves._done
        assert w.stats()["saved_tokens"] >= 3 * 2 * CS


def test_preemption_waits_for_background_saves(tiny_model, reference, monkeypatch):
    """A KV cache of 16 blocks (bf16) and 4 requests of 5 blocks decoding 180 tokens each:
    vLLM preempts; the worker drains the queue first; outputs match, later hits too."""
    prompts = [random_prompt(2 * CS + 90, 530 + i) for i in range(4)]
    ref = reference(prompts, max_tokens=180)
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted: list[str] = []
    orig = Scheduler._preempt_request

    def count(self, request, *a, **kw):
        preempted.append(request.request_id)
        return orig(self, request, *a, **kw)

    monkeypatch.setattr(Scheduler, "_preempt_request", count)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would override the small cache
    with make_llm(
        tiny_model, kv_cache_memory_bytes=2 << 20, max_model_len=1024, extra={"connector": {"async_saves": True}}
    ) as llm:
        w = worker()
        out = run(llm, prompts, greedy(180))
        assert token_ids(out) == ref
        assert preempted, "no preemption happened: the test did not exercise the drain"
        assert w.saves.drains > 0
        w.saves.drain()
        warm = run(llm, prompts, greedy(180))
        assert token_ids(warm) == ref
        assert all(o.num_cached_tokens >= 2 * CS for o in warm)


def test_requests_whose_saves_are_done_are_freed_at_once(tiny_model, reference):
    """A request that decodes long enough for its background saves to finish is freed
    when it finishes (the workers reported its saves done), not a step later, and is
    never reported in finished_sending; the control: saves held back by a gate until
    after the requests finish are held and reported as before. Tokens identical, later
    hits served, every block back."""
    import threading

    prompts = [random_prompt(2 * CS + 40, 540 + i) for i in range(3)]
    ref = reference(prompts, max_tokens=48)
    others = [random_prompt(2 * CS + 40, 550 + i) for i in range(2)]
    ref2 = reference(others, max_tokens=8)
    with make_llm(tiny_model, extra={"connector": {"async_saves": True}}) as llm:
        w = worker()
        sched = scheduler_side(llm)
        assert token_ids(run(llm, prompts, greedy(48))) == ref
        assert sched.freed_early >= 1, "no request was freed at once"
        early, held = sched.freed_early, sched.held_requests
        # the control: saves blocked until the requests have finished
        gate = threading.Event()
        real = w.saves._save
        w.saves._save = lambda t, meta: (gate.wait(30), real(t, meta))
        try:
            assert token_ids(run(llm, others, greedy(8))) == ref2
        finally:
            gate.set()
        w.saves.drain()
        run(llm, [random_prompt(20, 560)])  # one more step collects finished_sending
        assert sched.held_requests >= held + 2 and sched.freed_early == early
        assert w.saves.reported == sched.held_requests
        warm = run(llm, prompts + others, greedy(8))
        assert all(o.num_cached_tokens >= 2 * CS for o in warm)
        run(llm, [random_prompt(20, 561)])
        free, total = _free_blocks(llm)
        assert free == total - 1
        assert not w.saves._seen and not w.saves._pending and not w.saves._done


def test_a_request_right_behind_a_slow_save_waits_steps_for_it_and_hits(tiny_model, reference, monkeypatch):
    """A background save that outlasts the worker's lookup wait (0.1 s; here held by a
    gate until the scheduler has deferred the next lookup once, then 0.3 s more): the
    same prompt sent again at once waits in vLLM's queue, looked up every step, and
    hits its whole chunks once they are stored. The control: without the step wait
    (``SAVE_WAIT_S = 0``) the same case recomputes the prompt."""
    import threading

    from lmcache_connector import scheduler as sched_mod

    a, b = random_prompt(2 * CS + 40, 570), random_prompt(2 * CS + 40, 571)
    ref = reference([a, b])
    with make_llm(tiny_model, max_num_batched_tokens=1024, extra={"connector": {"async_saves": True}}) as llm:
        w = worker()
        sched = scheduler_side(llm)
        gate = threading.Event()
        real_save, real_wait = w.saves._save, sched._wait_for_saving

        timers: list[threading.Timer] = []

        def deferred(st):
            if not timers:  # the first deferral of this round opens the gate 0.3 s later
                timers.append(threading.Timer(0.3, gate.set))
                timers[0].start()
            return real_wait(st)

        w.saves._save = lambda t, meta: (gate.wait(30), real_save(t, meta))
        sched._wait_for_saving = deferred
        try:
            for prompt, expect, waits in ((a, ref[0], 1), (b, ref[1], 0)):
                gate.clear()
                timers.clear()
                if prompt is b:  # the control
                    monkeypatch.setattr(sched_mod, "SAVE_WAIT_S", 0.0)
                before = sched.save_waits
                assert token_ids(run(llm, [prompt])) == [expect]
                again = run(llm, [prompt])
                assert token_ids(again) == [expect]
                assert timers, "the second lookup found nothing being saved: the test did not exercise the wait"
                timers[0].join()
                assert sched.save_waits - before == waits
                assert again[0].num_cached_tokens == (2 * CS if waits else 0)
                w.saves.drain()
        finally:
            gate.set()
