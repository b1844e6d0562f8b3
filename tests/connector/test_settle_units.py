"""Units of ``connector.save_decode_cache: prefill`` (features/settle.py): what the
scheduler side settles when a request finishes, who waits for a settle, how the state
scheduler turns a plan into a vLLM request and hides its outputs. Real vLLM Request
and output objects, no engine; the feature inside real vLLM: test_e2e_hybrid.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from lmcache_connector.settings import ConnectorConfig, ConnectorSection  # noqa: E402
from lmcache_core.config import ConfigError, LoadedConfig, load_config  # noqa: E402
from lmcache_core.testing import ManualClock  # noqa: E402
from lmcache_connector.protocol.lookup_ipc import LookupAnswer  # noqa: E402
from lmcache_connector.features import settle as settle_module  # noqa: E402
from lmcache_connector.features.settle import PREFIX, WAIT_S, Settler, resolve  # noqa: E402
from lmcache_connector.layouts.groups import STATE_SCHEDULER  # noqa: E402
from lmcache_connector.options import ConnectorSettings  # noqa: E402
from lmcache_connector.scheduler import make_scheduler  # noqa: E402

CS = 256


class _Lookup:
    """Answers a fixed number of stored chunks and records the calls."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.calls = 0

    def lookup(self, hashes, pin_id, alts=None):
        self.calls += 1
        return LookupAnswer(min(self.n, len(hashes)))

    def close(self):
        pass


def _side(settle: bool = True, lookup: _Lookup | None = None, **connector):
    settings = ConnectorSettings(LoadedConfig(ConnectorConfig(chunk_size=CS, connector=ConnectorSection(**connector))))
    return make_scheduler(settings, block_size=128, can_load=True, can_save=True, lookup=lookup or _Lookup(), settle=settle)


def _request(tokens, rid="r", params=None, salt=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=400, extra_args={"kv_transfer_params": params} if params else None)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None, cache_salt=salt)


def _finish(req, answer, status="FINISHED_LENGTH_CAPPED"):
    """``req`` as vLLM leaves it at a finish: its answer appended, KV computed for all
    but the last token."""
    from vllm.v1.request import RequestStatus

    for t in answer:
        req.append_output_token_ids(t)
    req.num_computed_tokens = req.num_tokens - 1
    req.status = RequestStatus[status]
    return req


def _prompt(n, base=1000):
    return [base + (i * 7919) % 5000 for i in range(n)]


def _finished(side, **kw):
    """A 300-token request whose prefill stored chunk 0, finished with a 300-token
    answer (KV for 599 tokens: chunk 1 whole), as vLLM hands it to the connector."""
    req = _request(_prompt(300), **kw)
    side.get_num_new_matched_tokens(req, 0)
    side._reqs[req.request_id].saved_full = 1
    _finish(req, _prompt(300, 7))
    side.request_finished(req)
    return req


# -- Settler ------------------------------------------------------------------------------
def test_a_request_waits_for_a_settle_that_stores_its_chunks_until_it_finishes():
    clock = ManualClock(100.0)
    s = Settler(wait_s=10.0, clock=clock)
    plan = s.plan(SimpleNamespace(request_id="a"), [1, 2, 3], [b"h1", b"h2"])
    assert plan is not None and plan.req_id.startswith(PREFIX) and s.take() == [plan] and s.take() == []
    assert s.must_wait("b", [b"h0", b"h2"]) and s.must_wait("b", [b"h0", b"h2"])
    assert not s.must_wait("c", [b"other"])  # negative control: shares no chunk with it
    assert not s.must_wait(plan.req_id, [b"h1"])  # the settle itself never waits
    s.done(plan.req_id)
    assert not s.must_wait("b", [b"h0", b"h2"])
    assert (s.planned, s.finished, s.waits, s.gave_up, s.in_flight) == (1, 1, 1, 0, 0)


def test_a_waiting_request_gives_up_after_wait_s_once_and_for_all():
    clock = ManualClock(100.0)
    s = Settler(wait_s=10.0, clock=clock)
    s.plan(SimpleNamespace(request_id="a"), [1], [b"h1"])
    assert s.must_wait("b", [b"h1"])
    clock.now += 9.9
    assert s.must_wait("b", [b"h1"])
    clock.now += 0.2
    assert not s.must_wait("b", [b"h1"])
    assert not s.must_wait("b", [b"h1"])  # never waits again, counted once
    assert (s.waits, s.gave_up) == (1, 1)
    s.done("b")  # the request finished: forgotten
    assert s.must_wait("b", [b"h1"])  # (a new request under the same id waits afresh)


def test_settles_in_flight_are_bounded():
    s = Settler(max_in_flight=2)
    assert s.plan(None, [1], [b"a"]) and s.plan(None, [1], [b"b"])
    assert s.plan(None, [1], [b"c"]) is None
    assert (s.planned, s.skipped, s.in_flight) == (2, 1, 2)


def test_idle_settles_are_handed_over_only_when_idle_as_many_as_a_step_holds():
    s = Settler(when="idle")
    a, b, c = (s.plan(None, [1], [h], new_tokens=300) for h in (b"a", b"b", b"c"))
    big = s.plan(None, [1], [b"d"], new_tokens=900)
    assert s.take(idle=False, budget=1000) == [] and s.in_flight == 4  # busy: all stay queued
    assert s.take(idle=True, budget=1000) == [a, b, c]  # 900 tokens; the next would make 1,800
    assert s.take(idle=True, budget=1000) == [big]
    assert s.take(idle=True, budget=1000) == []
    # negative control: always hands every plan over at once, busy or not
    e = Settler(when="always")
    plans = [e.plan(None, [1], [b"a"], new_tokens=900), e.plan(None, [1], [b"b"], new_tokens=900)]
    assert e.take(idle=False, budget=1000) == plans


def _long_settle(s: Settler, prompt_chunks: int, answer_chunks: int, cs: int):
    """Plan a settle of ``answer_chunks`` whole chunks after ``prompt_chunks`` stored
    ones, as the scheduler side does; returns the plan and every chunk hash."""
    hashes = [i.to_bytes(4, "little") for i in range(prompt_chunks + answer_chunks)]
    tokens = list(range((prompt_chunks + answer_chunks) * cs + 1))
    plan = s.plan(
        SimpleNamespace(request_id="long"), tokens, hashes[prompt_chunks:], hashes[:prompt_chunks], answer_chunks * cs + 1
    )
    assert plan is not None
    return plan, hashes


def test_an_idle_settle_longer_than_a_step_runs_in_step_sized_pieces():
    """Hardening round 3: settle_when: idle handed over a settle of any size (120,000
    tokens against a 2,048-token step budget), so a request arriving meanwhile waited
    for the whole prefill instead of about one step. Now each piece handed over fits
    one step, every answer chunk is settled exactly once, in order, and the next piece
    waits for the previous one."""
    cs, budget = 240, 2048
    s = Settler(when="idle")  # the chunk size comes from the plan (the scheduler side gives it too)
    plan, hashes = _long_settle(s, 2, 500, cs)
    assert plan.new_tokens == 120_001  # 500 chunks of 240 tokens, plus the one token vLLM computes
    pieces = []
    while got := s.take(idle=True, budget=budget):
        assert len(got) == 1 and got[0].new_tokens <= budget, got[0].new_tokens
        piece = got[0]
        n = len(piece.prefix) + len(piece.stores)
        assert piece.prefix == tuple(hashes[: len(piece.prefix)]) and piece.tokens == plan.tokens[: n * cs + 1]
        assert piece.new_tokens == len(piece.stores) * cs + 1
        assert s.take(idle=True, budget=budget) == []  # the next piece waits for this one
        pieces.append(piece)
        s.done(piece.req_id)
    assert len(pieces) == 63 and [len(p.stores) for p in pieces] == [8] * 62 + [4]  # 8 chunks: 1,921 tokens a step
    assert [h for p in pieces for h in p.stores] == hashes[2:]  # each answer chunk once, in order
    assert pieces[-1].tokens == plan.tokens and pieces[-1].req_id == plan.req_id
    assert (s.planned, s.finished, s.pieces, s.dropped, s.in_flight) == (1, 1, 62, 0, 0)  # one settle, counted once
    # negative control: settle_when: always hands the whole settle over at once (by design)
    a = Settler(when="always", chunk_size=cs)
    whole, _ = _long_settle(a, 2, 500, cs)
    assert a.take(idle=True, budget=budget) == [whole]


def test_a_request_arriving_during_a_long_idle_settle_waits_about_one_step():
    """Between pieces the engine is busy with the request: no piece is handed over.
    A request needing the running piece's chunks waits for that piece only (one step);
    one needing the chunks after it supersedes the rest and computes them itself."""
    cs, budget = 240, 2048
    s = Settler(when="idle")
    _, hashes = _long_settle(s, 2, 500, cs)
    [first] = s.take(idle=True, budget=budget)
    assert s.must_wait("next", hashes[:5])  # shares the running piece's chunks: waits for it
    assert not s.must_wait("other", [b"unrelated"])  # negative control: shares nothing
    assert s.take(idle=False, budget=budget) == []  # busy: nothing more is handed over
    s.done(first.req_id)
    assert not s.must_wait("next", hashes[:5])  # one piece later it goes on
    assert not s.must_wait("turn2", hashes[:40])  # needs the queued rest: computes it itself
    assert (s.superseded, s.in_flight) == (1, 0) and s.take(idle=True, budget=budget) == []


def test_a_settle_of_which_no_chunk_fits_a_step_is_not_handed_over_at_idle(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(settle_module.log, "warning", lambda msg, *args: said.append(msg % args))
    s = Settler(when="idle", chunk_size=256)
    _long_settle(s, 1, 3, 256)
    assert s.take(idle=True, budget=256) == []  # one chunk and one token: 257
    assert (s.dropped, s.too_long, s.in_flight) == (1, 1, 0)
    assert len(said) == 1 and "do not fit in one step's token budget (256)" in said[0]
    # negative control: with room for one chunk and its token, it runs in pieces of one chunk
    _long_settle(s, 1, 3, 256)
    assert [p.new_tokens for p in s.take(idle=True, budget=257)] == [257]


def test_a_request_supersedes_a_queued_idle_settle_and_waits_for_a_running_one():
    clock = ManualClock(100.0)
    s = Settler(when="idle", clock=clock)
    queued = s.plan(None, [1], [b"h1"])
    assert not s.must_wait("next", [b"h0", b"h1"])  # it computes h1 itself, at once
    assert (s.superseded, s.waits, s.in_flight) == (1, 0, 0) and s.take(idle=True) == []
    assert queued is not None
    # once handed to the scheduler (running), a request waits for it as with always
    running = s.plan(None, [1], [b"h2"])
    assert s.take(idle=True) == [running]
    assert s.must_wait("next2", [b"h2"]) and (s.superseded, s.waits) == (1, 1)


def test_idle_settles_past_the_bound_drop_the_oldest_queued():
    s = Settler(when="idle", max_in_flight=2)
    a, b = s.plan(None, [1], [b"a"]), s.plan(None, [1], [b"b"])
    c = s.plan(None, [1], [b"c"])
    assert c is not None and (s.dropped, s.skipped, s.in_flight) == (1, 0, 2)
    assert s.take(idle=True) == [b, c]
    # with none queued (both running), a new one is skipped
    assert s.plan(None, [1], [b"d"]) is None and s.skipped == 1
    assert a is not None


def test_resolve_says_what_is_missing():
    ok = dict(has_state=True, state_scheduler=True, can_load=True, can_save=True)
    assert resolve("prefill", **ok) == (True, None)
    assert resolve("prefill", **{**ok, "has_state": False}) == (True, None)  # any model
    on, why = resolve("prefill", **{**ok, "state_scheduler": False})
    assert not on and f"--scheduler-cls {STATE_SCHEDULER}" in why
    on, why = resolve("prefill", **{**ok, "can_load": False})
    assert not on and "kv_both" in why
    on, why = resolve(True, **ok)
    assert not on and "save_decode_cache: prefill" in why
    # negative controls: nothing to say
    assert resolve(True, **{**ok, "has_state": False}) == (False, None)
    assert resolve(False, **ok) == (False, None)


def test_the_config_key_takes_true_false_or_prefill(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("connector: {save_decode_cache: prefill}\n")
    assert load_config(p, env={}, model=ConnectorConfig).config.connector.save_decode_cache == "prefill"
    env = {"LMCACHE_CORE_CONNECTOR_SAVE_DECODE_CACHE": "prefill"}
    assert load_config(None, env=env, model=ConnectorConfig).config.connector.save_decode_cache == "prefill"
    assert (
        load_config(
            None, env={"LMCACHE_CORE_CONNECTOR_SAVE_DECODE_CACHE": "true"}, model=ConnectorConfig
        ).config.connector.save_decode_cache
        is True
    )
    for bad in ("decode", "1", "yes"):
        p.write_text(f"connector: {{save_decode_cache: '{bad}'}}\n")
        with pytest.raises(ConfigError, match="save_decode_cache.*must be true, false or prefill"):
            load_config(p, env={}, model=ConnectorConfig)


# -- the scheduler side ---------------------------------------------------------------------
def test_a_finished_answer_with_a_new_whole_chunk_is_settled():
    side = _side()
    req = _request(_prompt(300))
    side.get_num_new_matched_tokens(req, 0)
    st = side._reqs["r"]
    st.saved_full = 1  # its prefill stored chunk 0
    _finish(req, _prompt(300, 7)[:300])  # 600 tokens, KV for 599: chunks 0 and 1 whole
    side.request_finished(req)
    [plan] = side.take_settles()
    assert plan.tokens == list(req.all_token_ids[: 2 * CS + 1]) and plan.source is req
    assert side.settler.in_flight == 1
    # the next turn (this conversation + a message) waits; an unrelated prompt does not
    lookup = side.lookup_client
    nxt = _request(list(req.all_token_ids) + _prompt(50, 3), rid="next")
    assert side.get_num_new_matched_tokens(nxt, 0) == (None, False) and lookup.calls == 1
    other = _request(_prompt(700, 11), rid="other")
    assert side.get_num_new_matched_tokens(other, 0) == (0, False) and lookup.calls == 2
    # the settle runs as a request of its own, looks up, finishes; then the next turn looks up
    settle = _request(plan.tokens, rid=plan.req_id)
    assert side.get_num_new_matched_tokens(settle, 0) == (0, False)
    _finish(settle, [5])
    side.request_finished(settle)
    assert side.take_settles() == []  # a settle is never settled again
    assert side.get_num_new_matched_tokens(nxt, 0) == (0, False) and lookup.calls == 4
    assert (side.settler.planned, side.settler.finished, side.settler.waits) == (1, 1, 1)


class _Stored:
    """Answers how many leading chunks of a lookup are in ``have``."""

    def __init__(self) -> None:
        self.have: set[bytes] = set()

    def lookup(self, hashes, pin_id, alts=None):
        n = 0
        while n < len(hashes) and hashes[n] in self.have:
            n += 1
        return LookupAnswer(n)

    def close(self):
        pass


def _run_settle(side, plan):
    """The settle request runs in vLLM and finishes (its one token sampled)."""
    settle = _request(plan.tokens, rid=plan.req_id)
    side.get_num_new_matched_tokens(settle, 0)
    _finish(settle, [5])
    side.request_finished(settle)


def test_the_next_piece_of_an_idle_settle_waits_for_the_chunks_of_the_one_before():
    """The scheduler side: a 5-chunk answer against a 600-token step goes in pieces of
    2 chunks (513 tokens). A piece waits for the chunks of the one before to be stored
    (a background save may land after the request finished), at most WAIT_S; a piece
    whose prompt chunks left the cache is dropped at once."""
    lookup, clock = _Stored(), ManualClock(100.0)
    side = _side(lookup=lookup, settle_when="idle")
    side.settler._clock = clock
    req = _request(_prompt(300))
    side.get_num_new_matched_tokens(req, 0)
    st = side._reqs["r"]
    st.saved_full = 1
    _finish(req, _prompt(1300, 7))  # 1,600 tokens, KV for 1,599: chunks 0-5 whole
    side.request_finished(req)
    h = st.hashes
    lookup.have = {h[0]}  # the prompt's chunk
    [p1] = side.take_settles(idle=True, budget=600)
    assert (p1.prefix, p1.new_tokens, p1.tokens) == ((h[0],), 2 * CS + 1, list(req.all_token_ids[: 3 * CS + 1]))
    _run_settle(side, p1)
    assert side.take_settles(idle=True, budget=600) == []  # p1's chunks are not stored yet: the rest waits
    lookup.have |= {h[1], h[2]}
    [p2] = side.take_settles(idle=True, budget=600)
    assert (p2.prefix, p2.new_tokens) == ((h[0], h[1], h[2]), 2 * CS + 1)
    _run_settle(side, p2)  # its chunks never get stored (say the tier refused them)
    assert side.take_settles(idle=True, budget=600) == []
    clock.now += WAIT_S + 0.1
    assert side.take_settles(idle=True, budget=600) == []
    s = side.settler
    assert (s.dropped, s.finished, s.pieces, s.in_flight) == (1, 0, 2, 0)
    assert side.take_stats_delta() == {"settles_dropped": 1}  # one settle, not one per piece
    # negative control: the prompt's chunk left the cache: the next piece is dropped at once
    side2 = _side(lookup=lookup, settle_when="idle")
    req2 = _request(_prompt(300), rid="r2")
    side2.get_num_new_matched_tokens(req2, 0)
    side2._reqs["r2"].saved_full = 1
    side2.request_finished(_finish(req2, _prompt(1300, 7)))
    lookup.have = {h[0]}
    [q1] = side2.take_settles(idle=True, budget=600)
    _run_settle(side2, q1)
    lookup.have = {h[1], h[2]}  # the piece's chunks are there, the prompt's is gone
    assert side2.take_settles(idle=True, budget=600) == [] and (side2.settler.dropped, side2.settler.in_flight) == (1, 0)


@pytest.mark.parametrize("stored", [1, 0])
def test_an_idle_settle_runs_only_while_its_prompt_is_stored(stored):
    """settle_when: idle hands a settle over when the engine is idle, if
    the prompt's chunks it should hit are still stored (looked up without a pin);
    control: they left the cache, so it is dropped instead of recomputing the prompt."""
    lookup = _Lookup(n=stored)
    side = _side(lookup=lookup, settle_when="idle")
    req = _finished(side)
    assert side.take_settles(idle=False) == [] and lookup.calls == 1  # busy: not even looked up
    plans = side.take_settles(idle=True)
    assert lookup.calls == 2
    if stored:
        assert [p.tokens for p in plans] == [list(req.all_token_ids[: 2 * CS + 1])] and side.settler.in_flight == 1
        assert plans[0].new_tokens == CS + 1  # the answer's chunk and one token; the prompt's chunk is loaded
    else:
        assert plans == [] and (side.settler.dropped, side.settler.in_flight) == (1, 0)


def test_the_settle_when_key_takes_always_or_idle(tmp_path):
    assert ConnectorSection().settle_when == "always"  # what save_decode_cache: prefill did before the key
    env = {"LMCACHE_CORE_CONNECTOR_SETTLE_WHEN": "idle"}
    assert load_config(None, env=env, model=ConnectorConfig).config.connector.settle_when == "idle"
    p = tmp_path / "c.yaml"
    p.write_text("connector: {settle_when: later}\n")
    with pytest.raises(ConfigError, match="settle_when"):
        load_config(p, env={}, model=ConnectorConfig)


@pytest.mark.parametrize(
    "case",
    ["aborted", "no new chunk", "skip_save", "no settler"],
)
def test_what_is_not_settled(case):
    """Negative controls for the test above: each changes one thing ("no settler": the
    connector resolved save_decode_cache to no settles, see resolve)."""
    side = _side(settle=case != "no settler")
    params = {"lmcache.skip_save": True} if case == "skip_save" else None
    req = _request(_prompt(300), params=params)
    side.get_num_new_matched_tokens(req, 0)
    side._reqs["r"].saved_full = 1
    answer = _prompt(300, 7)[: 100 if case == "no new chunk" else 300]  # 400 tokens: no second whole chunk
    _finish(req, answer, "FINISHED_ABORTED" if case == "aborted" else "FINISHED_STOPPED")
    side.request_finished(req)
    assert side.take_settles() == []


def test_a_settle_request_has_the_finished_requests_chunk_keys():
    """Tags (kv_transfer_params) and the cache salt go into chunk keys: the settle
    copies them, so what it stores is what the next turn looks up."""
    from lmcache_connector.state_scheduler import settle_request

    side = _side()
    req = _finished(side, params={"lmcache.tag.user": "u1"}, salt="s1")
    [plan] = side.take_settles()
    settle = settle_request(plan)
    assert settle.request_id == plan.req_id and settle.max_tokens == 1 and settle.prompt_token_ids == plan.tokens
    assert (settle.cache_salt, settle.kv_transfer_params) == ("s1", {"lmcache.tag.user": "u1"})
    mine = side._state_for(settle).hashes
    nxt = side._state_for(_request(list(req.all_token_ids) + [1, 2], rid="n", params={"lmcache.tag.user": "u1"}, salt="s1"))
    assert mine == nxt.hashes[:2]
    # negative control: without the salt the keys differ
    unsalted = side._state_for(_request(plan.tokens, rid="x", params={"lmcache.tag.user": "u1"}))
    assert unsalted.hashes[0] != mine[0]


def test_settle_outputs_are_dropped_and_nothing_else():
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    from lmcache_connector.state_scheduler import drop_outputs

    hidden = {f"{PREFIX}1-a": None}
    outs = {
        0: EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(request_id="a", new_token_ids=[1]),
                EngineCoreOutput(request_id=f"{PREFIX}1-a", new_token_ids=[2]),
            ],
            finished_requests={"a", f"{PREFIX}1-a"},
        ),
        1: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="b", new_token_ids=[3])]),
    }
    drop_outputs(outs, hidden)
    assert [o.request_id for o in outs[0].outputs] == ["a"] and outs[0].finished_requests == {"a"}
    assert [o.request_id for o in outs[1].outputs] == ["b"] and outs[1].finished_requests is None


def test_settle_counters_reach_vllm_as_increments():
    """The scheduler side reports its settle counters through vLLM's connector stats
    (``/metrics``): increments since the last report, nothing when nothing changed."""
    side = _side(settle_when="always")
    assert side.take_stats_delta() == {}
    _finished(side)
    [plan] = side.take_settles()
    settle = _request(plan.tokens, rid=plan.req_id)
    side.get_num_new_matched_tokens(settle, 0)
    _finish(settle, [5])
    side.request_finished(settle)
    assert side.take_stats_delta() == {"settles": 1}
    assert side.take_stats_delta() == {}  # reported once
    assert _side(settle=False).take_stats_delta() == {}  # negative control: no settler, no counters


def test_a_settle_vllm_refused_counts_as_dropped_and_nobody_waits_for_it():
    side = _side()
    req = _finished(side)
    [plan] = side.take_settles()
    side.settle_dropped(plan.req_id)  # what the state scheduler says when vLLM refuses the request
    s = side.settler
    assert (s.dropped, s.finished, s.in_flight) == (1, 0, 0)
    nxt = _request(list(req.all_token_ids) + _prompt(50, 3), rid="next")
    assert side.get_num_new_matched_tokens(nxt, 0) == (0, False)  # looks up at once: nothing to wait for
    assert side.take_stats_delta() == {"settles_dropped": 1}
