"""End to end on real vLLM (CPU): the connector saves and loads KV, outputs stay
token-identical to a run without it. Prefix caching is off in the engines under test,
so every cached token counted by vLLM (``num_cached_tokens``) came from the connector.
"""

from __future__ import annotations

import json

import pytest
from lmcache_core.plugins import get_plugin_manager

from .conftest import greedy, make_llm, random_prompt, run, scheduler_side, token_ids, worker
from .plugins_for_tests import FlakyPlugin, TamperPlugin

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CS = 256  # default chunk_size


def test_hit_is_served_by_connector_and_token_identical(tiny_model, reference):
    prompts = [random_prompt(700, 1), random_prompt(1100, 2), random_prompt(200, 3)]
    ref = reference(prompts)
    with make_llm(tiny_model) as llm:
        cold = run(llm, prompts)
        assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
        assert token_ids(cold) == ref
        w = worker()
        before = w.stats()["loaded_tokens"]
        warm = run(llm, prompts)
        # 2 and 4 full chunks, and the whole 128-token blocks past them (block tails):
        # 700 = 512 + 128 + 60, 1100 = 1024 + 76 (no whole block), 200 = 128 + 72
        assert [o.num_cached_tokens for o in warm] == [640, 1024, 128]
        assert w.stats()["loaded_tokens"] - before == 640 + 1024 + 128
        assert token_ids(warm) == ref


def test_full_prompt_hit_recomputes_last_token(tiny_model, reference):
    prompt = random_prompt(512, 11)
    ref = reference([prompt])
    with make_llm(tiny_model) as llm:
        run(llm, [prompt])
        warm = run(llm, [prompt])
        assert warm[0].num_cached_tokens == 511
        assert token_ids(warm) == ref


def test_negative_control_tampered_kv_changes_output(tiny_model, reference):
    """If loaded KV were not used, tampering with it would change nothing."""
    prompts = [random_prompt(1024 + 40, 21 + i) for i in range(3)]
    ref = reference(prompts)
    pm = get_plugin_manager()
    with pm.registered(TamperPlugin(), name="test-tamper"):
        with make_llm(tiny_model, extra={"backends": [{"name": "tamper"}]}) as llm:
            run(llm, prompts)
            warm = run(llm, prompts)
    assert [o.num_cached_tokens for o in warm] == [1024] * 3
    assert token_ids(warm) != ref


def test_chunked_prefill_saves_each_chunk_once_then_full_hit(tiny_model, reference):
    prompt = random_prompt(1500, 31)  # 3 prefill steps of 512 tokens
    ref = reference([prompt])
    with make_llm(tiny_model, max_num_batched_tokens=512) as llm:
        run(llm, [prompt])
        eng = worker().engine
        tier = eng.tiers[0].stats()
        stored = 1500 // CS + 1  # the whole chunks and the block tail (one 128-token block)
        assert eng.stats()["stored_chunks"] == stored
        assert tier.puts == stored and tier.chunks == stored
        warm = run(llm, [prompt])
        assert warm[0].num_cached_tokens == (1500 // CS) * CS + 128
        assert token_ids(warm) == ref
        # the hit chunks are not stored again
        assert eng.stats()["stored_chunks"] == stored


def test_partial_prefix_hit_loads_exactly_shared_chunks(tiny_model, reference, tmp_path):
    """...and connector.access_log records both requests in the trace format: ids
    shared exactly where the KV is (3 chunks), nothing of the tokens."""
    shared = random_prompt(3 * CS + 100, 41)
    a = shared + random_prompt(300, 42)
    b = shared + random_prompt(300, 43)
    ref = reference([a, b])
    trace = tmp_path / "access.jsonl"
    with make_llm(tiny_model, extra={"connector": {"access_log": str(trace)}}) as llm:
        assert token_ids(run(llm, [a])) == ref[:1]
        w = worker()
        before = w.stats()["loaded_tokens"]
        out = run(llm, [b])
        assert out[0].num_cached_tokens == 3 * CS
        assert w.stats()["loaded_tokens"] - before == 3 * CS
        assert token_ids(out) == ref[1:]
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [(x["input_length"], x["output_length"]) for x in lines] == [(len(a), len(ref[0])), (len(b), len(ref[1]))]
    ida, idb = lines[0]["hash_ids"], lines[1]["hash_ids"]
    assert len(ida) == len(idb) == len(a) // CS and ida[:3] == idb[:3] and ida[3] != idb[3]
    assert 0 <= lines[0]["timestamp"] <= lines[1]["timestamp"]
    assert trace.stat().st_mode & 0o077 == 0


def test_many_concurrent_requests_identical_outputs(tiny_model, reference):
    prefixes = [random_prompt(2 * CS, 50 + i) for i in range(4)]
    prompts = [prefixes[i % 4] + random_prompt(60 + 7 * i, 60 + i) for i in range(12)]
    prompts += [random_prompt(300 + 11 * i, 80 + i) for i in range(6)]
    ref = reference(prompts)
    with make_llm(tiny_model, max_num_batched_tokens=1024) as llm:
        assert token_ids(run(llm, prompts)) == ref
        warm = run(llm, prompts)
        assert token_ids(warm) == ref
        assert all(o.num_cached_tokens >= 2 * CS for o in warm[:12])


def test_failed_load_is_recomputed_and_serving_continues(tiny_model, reference):
    prompts = [random_prompt(800, 91), random_prompt(900, 92)]
    later = [random_prompt(600, 93)]
    ref = reference(prompts + later)
    pm = get_plugin_manager()
    with pm.registered(FlakyPlugin(), name="test-flaky"):
        with make_llm(tiny_model, extra={"backends": [{"name": "flaky", "mode": "corrupt"}]}) as llm:
            run(llm, prompts)
            warm = run(llm, prompts)
            assert token_ids(warm) == ref[:2]
            w = worker()
            assert w.stats()["failed_loads"] >= 2
            assert w.engine.tiers[0].stats().extra["corrupt_reads"] >= 2
            # load_errors counts chunks (the engine's counter, shipped as is), failed_loads requests
            assert w.counters()["load_errors"] == w.engine.counters.load_errors >= w.stats()["failed_loads"]
            assert token_ids(run(llm, later)) == ref[2:]
        with make_llm(tiny_model, extra={"backends": [{"name": "flaky", "mode": "raise"}]}) as llm:
            run(llm, prompts)
            assert token_ids(run(llm, prompts)) == ref[:2]
            assert worker().stats()["failed_loads"] >= 2
            assert worker().engine.stats()["backend_errors"]["flaky"] >= 2


def test_skip_save_and_tags(tiny_model, reference):
    p = random_prompt(600, 101)
    q = random_prompt(600, 102)
    ref = reference([p, q])
    with make_llm(tiny_model) as llm:
        eng = worker().engine
        run(llm, [p], greedy(params={"lmcache.skip_save": True}))
        assert eng.stats()["stored_chunks"] == 0
        assert run(llm, [p])[0].num_cached_tokens == 0  # nothing was stored
        # tags are part of the key: another tag misses, the same tag hits
        run(llm, [q], greedy(params={"lmcache.tag.tenant": "a"}))
        assert run(llm, [q], greedy(params={"lmcache.tag.tenant": "b"}))[0].num_cached_tokens == 0
        assert run(llm, [q])[0].num_cached_tokens == 0
        hit = run(llm, [q], greedy(params={"lmcache.tag.tenant": "a"}))
        assert hit[0].num_cached_tokens == 2 * CS
        assert token_ids(hit) == ref[1:]
        # a malformed option is a warning and a cache bypass, never a failed request
        bad = run(llm, [q], greedy(params={"lmcache.skip_save": "yes"}))
        assert bad[0].num_cached_tokens == 0 and token_ids(bad) == ref[1:]


def test_priority_limit(tiny_model):
    p, q = random_prompt(600, 111), random_prompt(600, 112)
    with make_llm(tiny_model, extra={"connector": {"priority_limit": 0}}, scheduling_policy="priority") as llm:
        eng = worker().engine
        run(llm, [p], priority=[5])
        assert eng.stats()["stored_chunks"] == 0
        run(llm, [q], priority=[0])
        assert eng.stats()["stored_chunks"] == 2


def test_unfull_chunk_and_decode_saving(tiny_model, reference):
    p = random_prompt(300, 121)
    ref = reference([p], max_tokens=300)
    with make_llm(tiny_model) as llm:
        run(llm, [p])
        assert worker().engine.stats()["stored_chunks"] == 1  # the 44-token tail is dropped
    with make_llm(tiny_model, extra={"connector": {"save_unfull_chunk": True}}) as llm:
        run(llm, [p])
        assert worker().engine.stats()["stored_chunks"] == 2
        assert run(llm, [p])[0].num_cached_tokens == 299
    with make_llm(tiny_model, extra={"connector": {"save_decode_cache": True}}) as llm:
        out = run(llm, [p], greedy(300))
        assert token_ids(out) == ref
        # prompt (300) + 299 decoded tokens with KV computed: chunks 0 and 1 complete
        assert worker().engine.stats()["stored_chunks"] == 2
        # a follow-up turn that extends the conversation hits the decode chunk too
        follow = p + token_ids(out)[0] + random_prompt(50, 122)
        assert run(llm, [follow])[0].num_cached_tokens == 2 * CS


def test_settled_answers_serve_the_next_turn_on_a_dense_model(tiny_model, reference):
    """``save_decode_cache: prefill`` on a dense model with the state scheduler (it
    aligns nothing here, but runs the connector's settles): the follow-up turn hits the
    previous answer's whole chunks, which a settle prefilled once more, and its tokens
    equal vLLM's without the connector. Control: without the state scheduler nothing is
    settled (the connector warns at start-up) and the follow-up hits the prompt's chunk
    only."""
    from lmcache_connector.state_scheduler import QUALNAME

    p = random_prompt(300, 121)
    ref = reference([p], max_tokens=300)
    hits, follow_ups = {}, {}
    follow = p + ref[0] + random_prompt(50, 122)
    for sched in (QUALNAME, None):
        kw = {"scheduler_cls": sched} if sched else {}
        with make_llm(tiny_model, extra={"connector": {"save_decode_cache": "prefill"}}, **kw) as llm:
            assert token_ids(run(llm, [p], greedy(300))) == ref
            fo = run(llm, [follow])[0]
            hits[sched], follow_ups[sched] = fo.num_cached_tokens, token_ids([fo])[0]
            settler = scheduler_side(llm).settler
            counts = None if settler is None else (settler.planned, settler.finished, settler.waits)
            if sched:
                # prompt (300) + 299 decoded tokens with KV computed: chunk 1 is the answer's
                assert counts == (1, 1, 1)
            else:
                assert counts is None
    assert hits == {QUALNAME: 2 * CS, None: CS}
    assert follow_ups[QUALNAME] == follow_ups[None] == reference([follow])[0]  # (an engine of its own: after the others)


def _decode(n: int):
    """Greedy sampling of exactly ``n`` tokens (a request that keeps the engine busy)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _step_until(eng, cond, done: dict | None = None, steps: int = 3000) -> None:
    """Step vLLM's engine until ``cond()`` (bounded: each step computes at least one
    token of a request), recording finished outputs in ``done``."""
    for _ in range(steps):
        for out in eng.step():
            if out.finished and done is not None:
                done[out.request_id] = out
        if cond():
            return
    raise AssertionError(f"engine did not get there in {steps} steps: finished {sorted(done or {})}")


@pytest.mark.parametrize("when", ["idle", "always"])
def test_a_follow_up_while_the_engine_is_busy_supersedes_an_idle_settle(tiny_model, reference, when):
    """``settle_when: idle``: a request that finishes while another still
    decodes has its settle queued, not run; its follow-up, arriving then, computes the
    answer's chunk itself (the queued settle is dropped: nothing computed twice) and
    equals vLLM's tokens. Control, ``always``: the settle runs as the request finishes,
    the follow-up waits for it and hits the answer's chunk too."""
    from lmcache_connector.state_scheduler import QUALNAME

    from .conftest import tokens_prompt

    p, busy = random_prompt(300, 121), random_prompt(300, 141)
    ref = reference([p], max_tokens=300)
    follow = p + ref[0] + random_prompt(50, 122)
    ref_follow = reference([follow], max_tokens=16)
    extra = {"connector": {"save_decode_cache": "prefill", "settle_when": when}}
    with make_llm(tiny_model, extra=extra, scheduler_cls=QUALNAME) as llm:
        eng, done = llm.llm_engine, {}
        eng.add_request("a", tokens_prompt(p), greedy(300))
        eng.add_request("busy", tokens_prompt(busy), _decode(700))
        _step_until(eng, lambda: "a" in done, done)
        assert "busy" not in done  # still decoding: the engine is not idle
        eng.add_request("f", tokens_prompt(follow), greedy(16))
        _step_until(eng, lambda: "f" in done, done)
        settler = scheduler_side(llm).settler
        assert list(done["a"].outputs[0].token_ids) == ref[0]
        assert list(done["f"].outputs[0].token_ids) == ref_follow[0]
        if when == "idle":
            assert "busy" not in done
            assert done["f"].num_cached_tokens == CS  # the prompt's chunk; the answer's it computed itself
            assert (settler.superseded, settler.waits, settler.finished) == (1, 0, 0)
        else:
            assert done["f"].num_cached_tokens == 2 * CS
            assert (settler.superseded, settler.waits, settler.finished) == (0, 1, 1)
        _step_until(eng, lambda: "busy" in done, done)


def test_an_idle_settle_runs_when_an_abort_leaves_the_engine_idle(tiny_model):
    """``settle_when: idle``: a settle queued while another request decodes runs once
    that request is aborted (no step ends idle then: the abort itself must hand it
    over). Control: before the abort it stays queued."""
    from lmcache_connector.state_scheduler import QUALNAME

    from .conftest import tokens_prompt

    p, busy = random_prompt(300, 151), random_prompt(300, 152)
    extra = {"connector": {"save_decode_cache": "prefill", "settle_when": "idle"}}
    with make_llm(tiny_model, extra=extra, scheduler_cls=QUALNAME) as llm:
        eng, sched = llm.llm_engine, llm.llm_engine.engine_core.engine_core.scheduler
        settler = scheduler_side(llm).settler
        done: dict = {}
        eng.add_request("a", tokens_prompt(p), _decode(300))
        eng.add_request("busy", tokens_prompt(busy), _decode(700))
        _step_until(eng, lambda: "a" in done, done, steps=1000)
        assert (settler.planned, len(settler._plans)) == (1, 1)  # queued: "busy" still decodes
        eng.step()
        assert len(settler._plans) == 1 and sum(sched.get_request_counts()) == 1
        eng.abort_request(["busy"])
        assert len(settler._plans) == 0 and sum(sched.get_request_counts()) == 1  # the settle, handed over
        _step_until(eng, lambda: settler.finished > 0, steps=50)  # its outputs never reach the front end
        assert settler.finished == 1 and worker().engine.stats()["stored_chunks"] == 3  # two prompts, one answer


def test_roles_producer_then_consumer(tiny_model, reference, tmp_path):
    pytest.importorskip("lmcache_backend_disk")
    prompts = [random_prompt(700, 131), random_prompt(520, 132)]
    ref = reference(prompts)
    tiers = [{"name": "local_cpu", "max_size": "256MiB"}, {"name": "disk", "path": str(tmp_path / "kv")}]
    with make_llm(tiny_model, role="kv_producer", extra={"backends": tiers}) as llm:
        assert token_ids(run(llm, prompts)) == ref
        assert [o.num_cached_tokens for o in run(llm, prompts)] == [0, 0]  # producers never load
        eng = worker().engine
        assert eng.flush(30)
        assert eng.stats()["stored_chunks"] == 5  # 2 + 2 chunks, the 700-token prompt's block tail
    with make_llm(tiny_model, role="kv_consumer", extra={"backends": tiers}) as llm:
        out = run(llm, prompts)
        assert [o.num_cached_tokens for o in out] == [640, 512]
        assert token_ids(out) == ref
        assert worker().engine.stats()["stored_chunks"] == 0  # consumers never save
