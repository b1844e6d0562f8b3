"""A request whose chunks are still in a background save (``async_saves``) when it is
looked up: the worker's answer says so, and the scheduler side has vLLM ask again a
step later, for at most ``SAVE_WAIT_S``, instead of taking the smaller hit at once.
Real vLLM Request objects and the real lookup socket, no engine; inside real vLLM:
test_e2e_async_saves.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from lmcache_connector.options import ConnectorSettings  # noqa: E402
from lmcache_connector.protocol.lookup_ipc import LookupAnswer, LookupClient, LookupServer, _combine  # noqa: E402
from lmcache_connector.scheduler import SAVE_WAIT_S, make_scheduler  # noqa: E402
from lmcache_connector.settings import ConnectorConfig, ConnectorSection  # noqa: E402
from lmcache_core.config import LoadedConfig  # noqa: E402
from lmcache_core.testing import ManualClock  # noqa: E402

CS = 256


class _Saving:
    """A worker whose first ``saving`` answers say a save of the chunks is still
    running (the hit then is ``before``), then ``after`` chunks are stored."""

    def __init__(self, saving: int, before: int = 0, after: int = 2) -> None:
        self.saving, self.before, self.after = saving, before, after
        self.calls: list[str | None] = []

    def lookup(self, hashes, pin_id, alts=None):
        self.calls.append(pin_id)
        if len(self.calls) <= self.saving:
            return LookupAnswer(min(self.before, len(hashes)), saving=True)
        return LookupAnswer(min(self.after, len(hashes)))

    def close(self):
        pass


def _side(lookup, can_load=True):
    settings = ConnectorSettings(LoadedConfig(ConnectorConfig(chunk_size=CS, connector=ConnectorSection())))
    side = make_scheduler(settings, block_size=128, can_load=can_load, can_save=True, lookup=lookup)
    side.clock = ManualClock(100.0)
    return side


def _request(n, rid="r"):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    tokens = [1000 + (i * 7919) % 5000 for i in range(n)]
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4), pooling_params=None)


def test_the_saving_flag_crosses_the_socket_and_any_rank_saving_means_saving(tmp_path):
    assert LookupAnswer.decode(LookupAnswer(2, saving=True).encode()) == LookupAnswer(2, saving=True)
    assert LookupAnswer.decode(LookupAnswer(2, slow=True, tail=True).encode()).saving is False
    assert LookupAnswer.decode(b"3") == LookupAnswer(3)  # an answer from a worker without the flag
    assert _combine([LookupAnswer(2), LookupAnswer(3, saving=True)]) == LookupAnswer(2, saving=True)
    assert not _combine([LookupAnswer(2), LookupAnswer(3)]).saving
    addr = f"ipc://{tmp_path}/lk.ipc"
    server = LookupServer(addr, lambda hashes, pin: LookupAnswer(len(hashes) - 1, saving=pin == "behind"))
    client = LookupClient([addr], timeout_s=2.0)
    try:
        assert client.lookup([b"x" * 16] * 3, "behind") == LookupAnswer(2, saving=True)
        assert client.lookup([b"x" * 16] * 3, "other") == LookupAnswer(2)
    finally:
        client.close()
        server.close()


def test_a_request_whose_chunks_are_being_saved_is_asked_again_until_they_are_stored():
    lookup = _Saving(saving=3)
    side = _side(lookup)
    req = _request(2 * CS + 50)
    for _ in range(3):  # one lookup per step while the save runs, each pinning anew
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        side.clock.now += 0.1
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    assert lookup.calls == ["r"] * 4
    assert side.save_waits == 1 and side.take_stats_delta() == {"save_waits": 1}
    assert side.take_stats_delta() == {}  # reported once


def test_the_wait_for_a_save_is_bounded_then_the_stored_hit_is_taken():
    lookup = _Saving(saving=100, before=1)
    side = _side(lookup)
    req = _request(2 * CS + 50)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    side.clock.now += SAVE_WAIT_S - 0.01
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    side.clock.now += 0.02
    assert side.get_num_new_matched_tokens(req, 0) == (CS, False)  # what is stored by then
    assert side.save_waits == 1 and len(lookup.calls) == 3


def test_what_never_waits_for_a_save():
    # negative control: nothing is being saved, the hit is taken at the first lookup
    side = _side(_Saving(saving=0))
    assert side.get_num_new_matched_tokens(_request(2 * CS + 50), 0) == (2 * CS, False)
    # a producer (kv_producer) loads nothing: its lookup only avoids re-saving
    producer = _side(_Saving(saving=100, before=1), can_load=False)
    assert producer.get_num_new_matched_tokens(_request(2 * CS + 50), 0) == (0, False)
    assert side.save_waits == producer.save_waits == 0
