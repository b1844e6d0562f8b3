"""Connector pieces with real parts and no engine: request options, multimodal keys
(real vLLM Request objects), IPC lookups over real ZMQ sockets, layout adapters."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import zmq

pytest.importorskip("vllm")

from lmcache_connector.settings import ConnectorConfig, ConnectorSection  # noqa: E402
from lmcache_core.config import ConfigError, LoadedConfig  # noqa: E402
from lmcache_connector.layouts.kv_adapters import BlockLayout, LayoutError, TokenLayout, make_layout  # noqa: E402
from lmcache_connector.protocol.lookup_ipc import MISS, LookupAnswer, LookupClient, LookupServer  # noqa: E402
from lmcache_connector.options import ConnectorSettings, load_settings, parse_request_options  # noqa: E402
from lmcache_connector.scheduler import make_scheduler  # noqa: E402


def test_request_options():
    assert parse_request_options(None).skip_save is False
    o = parse_request_options({"lmcache.skip_save": True, "lmcache.tag.tenant": "acme", "other": 1})
    assert o.skip_save and o.tags == {"tenant": "acme"} and o.problem is None
    for bad in ({"lmcache.skip_save": "yes"}, {"lmcache.tag.": "x"}, {"lmcache.tag.a": [1]}, {"lmcache.skipsave": True}):
        b = parse_request_options(bad, "r1")
        assert b.skip_save and b.skip_load and "r1" in (b.problem or "")


def test_extra_config_overrides_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 512\nbackends: [{name: local_cpu, max_size: 64MiB}]\n")
    s = load_settings({"config_file": str(f), "connector": {"save_unfull_chunk": True, "model_id": "m1"}})
    assert s.core.chunk_size == 512 and s.core.connector.save_unfull_chunk and s.model_id == "m1"
    with pytest.raises(ConfigError, match=r"chunk_sise.*unknown key.*kv_connector_extra_config"):
        load_settings({"chunk_sise": 5})


def test_extra_config_connector_section_merges_with_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("connector:\n  save_unfull_chunk: true\n  load_policy: faster_than_recompute\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new spelling warns about nothing
        s = load_settings({"config_file": str(f), "connector": {"async_loads": True, "layerwise": True}})
    assert s.async_loads is True and s.layerwise is True
    assert s.core.connector.save_unfull_chunk and s.core.connector.load_policy == "faster_than_recompute"
    assert s.loaded.source_of("connector.async_loads") == "kv_connector_extra_config"
    assert s.loaded.source_of("connector.save_unfull_chunk") == str(f)
    assert s.with_chunk_size(64).core.connector == s.core.connector and s.with_chunk_size(64).core.chunk_size == 64


@pytest.mark.parametrize(
    ("key", "value"),
    [("async_loads", False), ("async_saves", True), ("layerwise", True), ("model_id", "m1"), ("save_unfull_chunk", True)],
)
def test_extra_config_old_flat_keys_move_with_one_warning(key, value):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        s = load_settings({key: value})
    msgs = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert msgs == [f"{key} (from kv_connector_extra_config) is deprecated: use connector.{key}"]
    assert getattr(s.core.connector, key) == value
    assert s.loaded.source_of(f"connector.{key}") == "kv_connector_extra_config"
    with pytest.raises(ConfigError, match=rf"{key}: both {key} \(deprecated\) and connector\.{key} are set"):
        load_settings({key: value, "connector": {key: value}})


def test_extra_config_that_is_not_a_mapping_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_connector_extra_config: expected a mapping of keys, got list"):
        load_settings([("chunk_size", 64)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_connector_extra_config.config_file: expected the path of a YAML file, got int"):
        load_settings({"config_file": 5})
    with pytest.raises(ConfigError, match=r"connector\.model_id: .*valid string.*\(from kv_connector_extra_config\)"):
        load_settings({"connector": {"model_id": 5}})


class _NoLookup:
    def lookup(self, hashes, pin_id):
        return 0

    def close(self):
        pass


def _request(tokens, mm=None, params=None, rid="r"):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None, mm_features=mm)


def _image(ident, offset, length):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=offset, length=length)
    )


def _sched(**cfg):
    settings = ConnectorSettings(LoadedConfig(ConnectorConfig(**cfg)))
    return make_scheduler(settings, block_size=128, can_load=True, can_save=True, lookup=_NoLookup())


def test_one_scheduler_object_per_mode():
    """The mode is chosen once from the model's KV-cache groups: one group gets the
    dense scheduler (partial chunks, sub-chunk hits, async options), several the
    grouped one (whole chunks only, loads reported asynchronously)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from lmcache_connector.layouts.groups import describe_groups
    from lmcache_connector.scheduler import DenseScheduler, GroupedScheduler

    kw = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    specs = {"dense": [FullAttentionSpec(**kw)], "grouped": [SlidingWindowSpec(sliding_window=40, **kw), FullAttentionSpec(**kw)]}
    connector = ConnectorSection(save_unfull_chunk=True, async_saves=True, async_loads=True)
    settings = ConnectorSettings(LoadedConfig(ConnectorConfig(connector=connector)))
    made = {}
    for name, group_specs in specs.items():
        groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(group_specs)]
        plan = describe_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), default_block_size=16)
        made[name] = make_scheduler(settings, block_size=16, can_load=True, can_save=True, lookup=_NoLookup(), plan=plan)
    dense, grouped = made["dense"], made["grouped"]
    assert type(dense) is DenseScheduler and type(grouped) is GroupedScheduler
    assert type(make_scheduler(settings, block_size=16, can_load=True, can_save=True, lookup=_NoLookup())) is DenseScheduler
    assert dense.async_saves and dense.async_loads and dense.subs is not None
    assert not grouped.async_saves and not grouped.async_loads and grouped.subs is None
    tokens = list(range(300))
    assert dense._state_for(_request(tokens)).partial is not None
    assert grouped._state_for(_request(tokens)).partial is None


def test_async_saves_option():
    auto = load_settings({})
    assert auto.core.connector.async_saves == "auto"
    assert auto.async_saves is False and not auto.saves_on_spare_cores  # not resolved for an engine yet
    assert auto.for_engine(True).async_saves is True and auto.for_engine(True).saves_on_spare_cores
    assert auto.for_engine(False).async_saves is False and not auto.for_engine(False).saves_on_spare_cores
    explicit = load_settings({"connector": {"async_saves": True}})
    assert explicit.async_saves is True
    # an explicit choice is kept whatever auto would say, and keeps the configured cores and nice
    assert explicit.for_engine(False).async_saves is True and not explicit.for_engine(True).saves_on_spare_cores
    assert load_settings({"connector": {"async_saves": False}}).for_engine(True).async_saves is False
    with pytest.raises(
        ConfigError, match=r"connector\.async_saves: .*must be true, false or auto, got 'yes' \(from kv_connector_extra_config\)"
    ):
        load_settings({"connector": {"async_saves": "yes"}})


def test_async_saves_auto_means_background_saves_on_the_vllm_cpu_server_only():
    from types import SimpleNamespace

    from lmcache_connector.features.cpu_cores import auto_async_saves

    def cfg(world):
        return SimpleNamespace(parallel_config=SimpleNamespace(world_size=world))

    assert auto_async_saves(cfg(1), cpu_platform=True, multiprocess=True)
    # negative controls: a GPU, the engine in process (offline batches, the tests), two ranks
    assert not auto_async_saves(cfg(1), cpu_platform=False, multiprocess=True)
    assert not auto_async_saves(cfg(1), cpu_platform=True, multiprocess=False)
    assert not auto_async_saves(cfg(2), cpu_platform=True, multiprocess=True)


def test_auto_background_saves_run_at_nice_19_on_the_given_cores(tmp_path):
    """async_saves: auto resolved to background saves: the save thread runs on the
    cores it is given, at nice 19, whatever background_nice says; explicit true keeps
    background_nice (the control)."""
    import os
    import time

    from lmcache_connector.options import load_settings as load
    from lmcache_connector.transfers.chunks import DenseTransfers

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs Linux thread affinity")
    cores = frozenset(sorted(os.sched_getaffinity(0))[-1:])
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for settings, want_nice, want_cores in (
        (load({}).for_engine(True), 19, cores),
        (load({"connector": {"async_saves": True}, "background_nice": 3}).for_engine(True), min(19, own + 3), None),
    ):
        w = _worker(tmp_path)
        tr = w.transfers
        try:
            t = DenseTransfers(
                tr.engine, tr.layout, tr.counters, tr.reports, tr.saver, 16, settings, ["l0", "l1"], save_cores=cores
            )
            try:
                assert t.saves is not None
                tid = t.saves._thread.native_id
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and os.getpriority(os.PRIO_PROCESS, tid) != want_nice:
                    time.sleep(0.01)
                assert os.getpriority(os.PRIO_PROCESS, tid) == want_nice
                if want_cores is not None:
                    assert os.sched_getaffinity(tid) == want_cores
                elif len(os.sched_getaffinity(0)) > 1:  # the control: left where it started
                    assert os.sched_getaffinity(tid) != cores
            finally:
                t.close()
        finally:
            w.close()


def test_async_loads_option():
    assert load_settings({}).async_loads == "auto"  # background loads for hits a slower tier serves
    assert load_settings({"connector": {"async_loads": True}}).async_loads is True
    assert load_settings({"connector": {"async_loads": False}}).async_loads is False
    with pytest.raises(
        ConfigError, match=r"connector\.async_loads: .*must be true, false or auto, got 1 \(from kv_connector_extra_config\)"
    ):
        load_settings({"connector": {"async_loads": 1}})


def test_lookup_hit_carries_slow_over_the_socket(tmp_path):
    addr = f"ipc://{tmp_path}/slow.ipc"
    server = LookupServer(addr, lambda hashes, pin: LookupAnswer(len(hashes) - 1, slow=pin == "far"))
    client = LookupClient([addr], timeout_s=2.0)
    try:
        near, far = client.lookup([b"x" * 16] * 4, "near"), client.lookup([b"x" * 16] * 4, "far")
        assert (near.chunks, near.slow) == (3, False) and (far.chunks, far.slow) == (3, True)
        assert not LookupAnswer(0, slow=True).slow  # nothing to load is never slow
    finally:
        client.close()
        server.close()


def test_load_queue_reports_completions_with_their_failed_blocks():
    """take() hands back finished loads together with their failed blocks; a load
    that raises fails the blocks it was to write (from write_from on), never the
    request's blocks below it (vLLM's own prefix cache); wait_idle waits, bounded."""
    import threading

    from lmcache_connector.transfers.async_loads import LoadQueue
    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    gate = threading.Event()

    def load(t, meta):
        if t.req_id == "slow":
            gate.wait(5)
        if t.req_id == "raises":
            raise RuntimeError("tier gone")
        return {7} if t.req_id == "partial" else set()

    q = LoadQueue(load, block_size=128)
    meta = LMCacheConnectorMetadata()
    # blocks 1..4 hold tokens 0..511; tokens below 256 are vLLM's own (write_from)
    transfers = [ChunkTransfer(r, [b"h" * 16], 1, [512], [1, 2, 3, 4], write_from=256) for r in ("slow", "partial", "raises")]
    q.submit(meta, transfers)
    try:
        assert not q.wait_idle(0.05)  # "slow" holds the thread: bounded wait, nothing done
        assert q.take() == (set(), set())
        gate.set()
        assert q.wait_idle(5)
        assert q.take() == ({"slow", "partial", "raises"}, {7, 3, 4})
        assert q.take() == (set(), set())  # each once
        assert (q.submitted, q.completed, q.failed) == (3, 3, 2)
    finally:
        q.close()


def test_save_queue_reports_exactly_the_saved_requests_once_done():
    """finished_sending names a request only if it saved through the queue, only
    once its saves are done (a failing save counts as done), and only once."""
    import threading

    from lmcache_connector.transfers.async_saves import SaveQueue
    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    gate = threading.Event()
    done = []

    def save(t, meta):
        if t.req_id == "slow":
            gate.wait(5)
        if t.req_id == "bad":
            raise RuntimeError("tier full")
        done.append(t.req_id)

    q = SaveQueue(save)
    meta = LMCacheConnectorMetadata()
    q.submit(meta, [ChunkTransfer(r, [b"h" * 16], 0, [256], [1, 2]) for r in ("slow", "fast", "bad")])
    try:
        assert q.finished({"slow", "fast", "never-saved"}) == set()  # fast waits behind slow (one thread, in order)
        gate.set()
        q.drain()
        assert done == ["slow", "fast"]
        assert q.finished(set()) == {"slow", "fast"}  # finished earlier, reported now
        assert q.finished({"bad"}) == {"bad"}
        assert q.finished({"slow", "fast", "bad"}) == set()  # each once
        assert q.reported == 3 and q.drains == 1
    finally:
        q.close()


def test_multimodal_items_change_keys_from_their_chunk_on():
    tokens = [7] * 1024  # the same placeholder tokens for every image
    s = _sched()
    a = s._state_for(_request(tokens, [_image("img-A", 300, 200)], rid="a")).hashes
    b = s._state_for(_request(tokens, [_image("img-B", 300, 200)], rid="b")).hashes
    a2 = s._state_for(_request(tokens, [_image("img-A", 300, 200)], rid="a2")).hashes
    plain = s._state_for(_request(tokens, rid="p")).hashes
    assert a == a2
    assert a[0] == b[0] == plain[0]  # chunk 0 (tokens 0..255) holds no image
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # chunks 1.. differ
    assert a[1] != plain[1]


def test_requests_with_prompt_embeddings_neither_load_nor_save():
    """Keys name token ids, and every embedded position carries the same placeholder
    id whatever its embedding: two such prompts would share keys, so one would load
    the other's KV. They skip the cache; the same token ids without embeddings use it
    (the control)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    tokens = [151655] * 512 + [1, 2, 3, 4]
    mask = [False] * 512 + [True] * 4
    s = _sched()
    for rid, seed in (("a", 1), ("b", 2)):
        req = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            prompt_embeds=torch.randn(len(tokens), 8, generator=torch.Generator().manual_seed(seed)),
            prompt_is_token_ids=list(mask),
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
        )
        st = s._state_for(req)
        assert st.opts.skip_load and st.opts.skip_save and not st.save, rid
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    plain = s._state_for(_request(list(tokens), rid="p"))
    assert plain.save and not plain.opts.skip_load and len(plain.hashes) == 2


def test_a_save_skipped_for_want_of_blocks_is_not_marked_saved():
    """A save the scheduler skips (fewer blocks known than it needs) marks nothing
    saved and indexes nothing: the next step with the blocks saves it. Before, the
    prompt's tail was marked saved (never retried) and offered by the sub-chunk index."""
    from lmcache_connector.protocol.metadata import LMCacheConnectorMetadata

    s = _sched()  # 256-token chunks, 128-token blocks
    st = s._state_for(_request(list(range(400)), rid="r"))  # a whole chunk, then a block and 16 tokens
    assert st.save and st.block_tail is not None
    st.block_ids = [7]  # 1 of the 3 blocks the chunk and its block tail need
    meta = LMCacheConnectorMetadata(chunk_size=256)
    s._plan_save(st, 400, meta)
    assert meta.saves == [] and st.saved_full == 0 and not st.block_tail_saved
    assert s.subs is not None and len(s.subs) == 0  # nothing indexed
    st.block_ids = [7, 8, 9]
    s._plan_save(st, 400, meta)
    assert [t.chunk_ends for t in meta.saves] == [[256, 384]] and st.block_tail_saved and st.saved_full == 1
    assert len(s.subs) > 0


def test_tags_and_salt_change_keys():
    s = _sched()
    t = [5] * 512
    base = s._state_for(_request(t, rid="1")).hashes
    tagged = s._state_for(_request(t, params={"lmcache.tag.team": "x"}, rid="2")).hashes
    assert base[0] != tagged[0]


def test_lookup_server_and_timeout(tmp_path):
    addr = f"ipc://{tmp_path}/lk.ipc"
    seen = []

    def lookup(hashes, pin):
        seen.append((len(hashes), pin))
        return LookupAnswer(len(hashes) - 1)

    server = LookupServer(addr, lookup)
    client = LookupClient([addr], timeout_s=2.0)
    try:
        assert client.lookup([b"x" * 16] * 5, "req-1").chunks == 4
        assert client.lookup([b"y" * 16] * 3, None).chunks == 2
        assert seen == [(5, "req-1"), (3, None)]
    finally:
        client.close()
        server.close()
    # a worker that never answers: a miss within the timeout, never a hang
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(f"ipc://{tmp_path}/silent.ipc")
    client = LookupClient([f"ipc://{tmp_path}/silent.ipc"], timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert client.lookup([b"z" * 16] * 4, "r") == MISS
        assert time.monotonic() - t0 < 2.0
        assert client.timeouts == 1
    finally:
        client.close()
        silent.close(0)
        ctx.term()


def test_a_malformed_lookup_message_is_a_miss_and_the_server_goes_on(tmp_path):
    """A request id that is not UTF-8, a pin deadline that is not a number, a ragged
    hash blob: each gets a miss, and the next lookup is answered (the thread lived)."""
    from lmcache_connector.protocol.lookup_ipc import PROTO

    addr = f"ipc://{tmp_path}/lk.ipc"
    server = LookupServer(addr, lambda hashes, pin: LookupAnswer(len(hashes)))
    client = LookupClient([addr], timeout_s=2.0)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(addr)
    try:
        assert client.lookup([b"a" * 16], "r1").chunks == 1
        for bad in ([b"\xff\xfe", b"1"], [b"r", b"1:soon"], [b"r", b"1:"]):
            raw.send_multipart([PROTO, b"7", *bad, b"b" * 16])
            assert raw.poll(2000), bad
            assert raw.recv_multipart() == [PROTO, b"7", b"0"], bad
        raw.send_multipart([PROTO, b"8", b"r", b"0", b"b" * 15])
        assert raw.poll(2000) and raw.recv_multipart() == [PROTO, b"8", b"0"]
        assert server._thread.is_alive()
        assert client.lookup([b"a" * 16] * 2, "r2").chunks == 2
    finally:
        raw.close(0)
        ctx.term()
        client.close()
        server.close()


def test_a_lookup_its_client_gave_up_on_holds_no_pins(tmp_path):
    """The client counts a lookup unanswered within its timeout as a miss, and the
    request may finish (its one unpin sent) before the worker gets to it: pins taken
    then would never be released. One that ends late is released; one that arrives
    late is not even looked up. Control: in time, the pins stay (the unpin's)."""
    addr = f"ipc://{tmp_path}/lk.ipc"
    pinned: set[str] = set()
    calls: list[str] = []
    delay = {"s": 0.0}

    def lookup(hashes, pin):
        calls.append(pin)
        time.sleep(delay["s"])
        pinned.add(pin)
        return LookupAnswer(len(hashes))

    def settled(n):
        deadline = time.monotonic() + 5
        while server.late < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return server.late

    server = LookupServer(addr, lookup, release=pinned.discard)
    client = LookupClient([addr], timeout_s=0.3)
    try:
        assert client.lookup([b"a" * 16], "in-time").chunks == 1 and pinned == {"in-time"}
        delay["s"] = 0.6  # ends after the client's deadline
        assert client.lookup([b"a" * 16], "ends-late") == MISS
        assert settled(1) == 1 and pinned == {"in-time"}
        delay["s"] = 1.2  # holds the server thread past the next one's deadline
        assert client.lookup([b"a" * 16], "slow") == MISS
        assert client.lookup([b"a" * 16], "arrives-late") == MISS
        assert settled(3) == 3 and pinned == {"in-time"}
        assert calls == ["in-time", "ends-late", "slow"]  # never looked up: "arrives-late"
    finally:
        client.close()
        server.close()


def test_lookup_in_the_same_process_skips_the_socket(tmp_path):
    """A memory-only worker in this process is called directly; once it closes,
    the client goes back to the socket (nobody answers: a miss within the timeout)."""
    addr = f"ipc://{tmp_path}/inline.ipc"
    calls = []

    def lookup(hashes, pin):
        calls.append(pin)
        if pin == "boom":
            raise RuntimeError("tier broke")
        return LookupAnswer(len(hashes))

    server = LookupServer(addr, lookup, inline=True)
    client = LookupClient([addr], timeout_s=0.3)
    try:
        assert client.lookup([b"a" * 16] * 3, "r1").chunks == 3
        assert client.lookup([b"a" * 16] * 3, "boom") == MISS  # a failing cache is a miss
        assert client.inline_lookups == 2 and calls == ["r1", "boom"]
    finally:
        server.close()
    try:
        assert client.lookup([b"a" * 16] * 3, "r2") == MISS
        assert client.inline_lookups == 2 and client.timeouts == 1 and calls == ["r1", "boom"]
    finally:
        client.close()
    # not declared inline: always over the socket, even in the same process
    server = LookupServer(addr, lookup)
    client = LookupClient([addr], timeout_s=2.0)
    try:
        assert client.lookup([b"a" * 16] * 2, "r3").chunks == 2
        assert client.inline_lookups == 0
    finally:
        client.close()
        server.close()


def _paged(num_blocks=16, heads=2, bs=16, d=8, layers=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {f"l{i}": torch.randn(num_blocks, heads, bs, 2 * d, generator=g).to(dtype) for i in range(layers)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_layout_round_trip_and_skips_shared_blocks(dtype):
    src = _paged(dtype=dtype)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    a, b = BlockLayout(src, 16), BlockLayout(dst, 16)
    src_blocks, dst_blocks = [3, 7, 1, 9], [2, 5, 11, 4]
    buf = torch.empty(a.chunk_shape(64), dtype=dtype)
    a.save_chunk(src_blocks, 0, 64, buf)
    b.load_chunk(buf, dst_blocks, 0, 64, write_from=16)  # block 0 belongs to vLLM's prefix cache
    for name in src:
        assert torch.count_nonzero(dst[name][2]) == 0
        for s_id, d_id in zip(src_blocks[1:], dst_blocks[1:]):
            assert torch.equal(dst[name][d_id], src[name][s_id])
    assert "bs16" in a.fingerprint() and str(dtype).removeprefix("torch.") in a.fingerprint()


def test_block_layout_copies_runs_of_consecutive_blocks():
    """Consecutive block ids are copied as slices; mixed tables still land block by block."""
    from lmcache_connector.layouts.kv_adapters import block_runs

    assert block_runs([4, 5, 6, 10, 11]) == [(0, 4, 3), (3, 10, 2)]
    assert block_runs([4, 6]) is None and block_runs([]) is None
    src = _paged()
    a = BlockLayout(src, 16)
    for src_blocks, dst_blocks in (([3, 4, 5, 9, 10], [6, 7, 8, 1, 2]), ([3, 4, 5, 9, 10], [12, 1, 8, 2, 6])):
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        buf = torch.empty(a.chunk_shape(80))
        a.save_chunk(src_blocks, 0, 80, buf)
        BlockLayout(dst, 16).load_chunk(buf, dst_blocks, 0, 80, write_from=0)
        for name in src:
            for s_id, d_id in zip(src_blocks, dst_blocks):
                assert torch.equal(dst[name][d_id], src[name][s_id])
            untouched = [b for b in range(16) if b not in dst_blocks]
            assert torch.count_nonzero(dst[name][untouched]) == 0


def test_token_layout_refuses_cpu_backend_and_round_trips_logical_layout():
    src = _paged()
    with pytest.raises(LayoutError, match="layout: block"):
        TokenLayout(src, 16)
    with pytest.raises(LayoutError, match="unknown adapter"):
        make_layout("tokens", src, 16)
    t = TokenLayout(src, 16, allow_cpu=True)
    buf = torch.empty(t.chunk_shape(40))
    t.save_chunk([4, 2, 8], 0, 40, buf)
    # per-token K of token 17 = block 2, offset 1, first half of the last dim
    assert torch.equal(buf[1, 0, 17], src["l1"][2, :, 1, :8])
    assert torch.equal(buf[1, 1, 17], src["l1"][2, :, 1, 8:])
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    TokenLayout(dst, 16, allow_cpu=True).load_chunk(buf, [0, 5, 6], 0, 40, write_from=0)
    assert torch.equal(dst["l0"][5, :, 1], src["l0"][2, :, 1])
    assert torch.equal(dst["l2"][6, :, 7], src["l2"][8, :, 7])


def test_cpu_core_reservation_advice():
    """vLLM-CPU reserves a core per rank more when any KV connector is configured; the
    connector says how to give it back, and says nothing once the count is set."""
    from types import SimpleNamespace

    from lmcache_connector.features.cpu_cores import ENV, reservation_advice

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(local_world_size=1, world_size=1))
    two = reservation_advice(cfg, env={}, cores=2)
    assert two is not None and f"{ENV}=1" in two and "reserves none" in two
    eight = reservation_advice(cfg, env={}, cores=8)
    assert eight is not None and "leaving the model 6" in eight
    tp2 = SimpleNamespace(parallel_config=SimpleNamespace(local_world_size=2, world_size=2))
    assert f"{ENV}=2" in (reservation_advice(tp2, env={}, cores=4) or "")
    assert reservation_advice(cfg, env={ENV: "1"}, cores=2) is None


def _worker(tmp_path, **extra):
    from lmcache_connector.options import load_settings
    from lmcache_connector.worker import WorkerSide

    extra.setdefault("backends", [{"name": "local_cpu", "max_size": "64MiB"}])
    settings = load_settings({"chunk_size": 16, **extra})
    w = WorkerSide(settings, model_id="m", block_size=16, rank=0, world_size=1, lookup_address=None)
    g = torch.Generator().manual_seed(5)
    w.register_kv_caches({f"l{i}": torch.randn(16, 2, 16, 16, generator=g) for i in range(2)})
    return w


def test_async_saves_with_vllm_033_call_order(tmp_path):
    """vLLM 0.33's GPU runner asks for transfer results before wait_for_save (and, with
    a draft model, calls wait_for_save after the next results): a finished request is
    reported in finished_sending only once the saves planned for it are done, whatever
    the order."""
    import threading

    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    w = _worker(tmp_path, connector={"async_saves": True})
    gate = threading.Event()
    real = w.saves._save
    w.saves._save = lambda t, meta: (gate.wait(10), real(t, meta))
    try:
        step = LMCacheConnectorMetadata(
            chunk_size=16, saves=[ChunkTransfer("R", [b"a" * 16, b"b" * 16], 0, [16, 32], [3, 4])], step_tokens=32
        )
        w.step_started(step)
        w.start_load_kv(step)
        assert w.take_finished_saves(set()) == set()  # 0.33: results first...
        w.wait_for_save(step)  # ...then this step's saves are handed over
        nxt = LMCacheConnectorMetadata(chunk_size=16)
        w.step_started(nxt)
        assert w.take_finished_saves({"R"}) == set(), "reported while its save was still pending"
        gate.set()
        w.saves.drain()
        assert w.take_finished_saves(set()) == {"R"}
        assert w.take_finished_saves(set()) == set()  # once
        assert w.engine.lookup_hashes([b"a" * 16, b"b" * 16]) == 2
    finally:
        gate.set()
        w.close()


def test_sleep_mode_drains_and_touches_no_block(tmp_path):
    """unregister_kv_caches (vLLM >= 0.33, before sleep) returns once queued saves are
    done; until restore_kv_caches no copy touches vLLM's blocks (loads are reported
    failed, saves skipped); afterwards the cache serves as before."""
    import threading

    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    w = _worker(tmp_path, connector={"async_saves": True})
    gate = threading.Event()
    real = w.saves._save
    w.saves._save = lambda t, meta: (gate.wait(10), real(t, meta))
    save = LMCacheConnectorMetadata(chunk_size=16, saves=[ChunkTransfer("R", [b"c" * 16], 0, [16], [5])], step_tokens=16)
    w.step_started(save)
    w.wait_for_save(save)
    threading.Timer(0.3, gate.set).start()
    w.suspend()  # waits for the queued save
    assert w.suspended and w.saves._pending == {} and w.engine.lookup_hashes([b"c" * 16]) == 1
    layer = w.layout.layers[0]
    before = layer.clone()
    load = LMCacheConnectorMetadata(chunk_size=16, loads=[ChunkTransfer("S", [b"c" * 16], 0, [16], [9])])
    w.step_started(load)
    w.start_load_kv(load)
    assert torch.equal(layer, before), "a load wrote vLLM's blocks during sleep"
    assert w.get_block_ids_with_load_errors() == {9}
    more = LMCacheConnectorMetadata(chunk_size=16, saves=[ChunkTransfer("T", [b"d" * 16], 0, [16], [6])], step_tokens=16)
    w.step_started(more)
    w.wait_for_save(more)
    w.saves.drain()
    assert w.engine.lookup_hashes([b"d" * 16]) == 0
    w.resume()
    w.step_started(load)
    w.start_load_kv(load)
    assert torch.equal(layer[9], layer[5]) and w.get_block_ids_with_load_errors() == set()
    w.close()


def test_pins_are_released_while_asleep(tmp_path):
    """Hardening round 3, item 4: requests that finish while vLLM sleeps release their
    pins (the step's ``unpins``) like any other step; before, 8 chunks stayed pinned
    and a full CPU tier then stored 0 of 8 new chunks. Control: the pins are held
    until that step."""
    from lmcache_connector.protocol.metadata import LMCacheConnectorMetadata

    w = _worker(tmp_path)
    try:
        pinned = [bytes([i]) * 16 for i in range(8)]
        data = torch.zeros(w.hits.chunk_shape, dtype=w.hits.chunk_dtype)
        for h in pinned:
            assert w.engine.store_hashes([h], [data]) == 1
        assert w.hits.lookup(pinned, "asleep-req").chunks == 8
        w.suspend()
        idle = LMCacheConnectorMetadata(chunk_size=16)
        w.step_started(idle)
        w.start_load_kv(idle)
        assert w.engine.pins.ids() == {"asleep-req"}  # control: nothing released it yet
        done = LMCacheConnectorMetadata(chunk_size=16, unpins=["asleep-req"])  # it finished during sleep
        w.step_started(done)
        w.start_load_kv(done)
        assert w.engine.pins.ids() == set(), "a request that finished during sleep kept its pins"
        w.resume()
    finally:
        w.close()


def test_auto_async_follows_the_tier_and_its_measured_speed(tmp_path):
    """async_loads: auto: a hit in the CPU tier loads in the step; one a slower tier
    serves goes to the background while that tier's speed is unknown or slow (more
    than 5 ms for these chunks), and stays in the step once it reads them fast."""
    backends = [{"name": "local_cpu", "max_size": "64MiB"}, {"name": "disk", "path": str(tmp_path / "d"), "max_size": "1GiB"}]
    w = _worker(tmp_path, backends=backends)
    try:
        nbytes = 3 * w.hits.chunk_bytes
        assert not w.hits.slow([(0, 3)], 3), "a memory hit left the step"
        assert w.hits.slow([(0, 1), (1, 2)], 3), "an unmeasured disk hit stayed in the step"
        for _ in range(4):
            w.engine.stack.tiers[1].read_model.record(nbytes, 0.050)
            w.engine.stack.tiers[1].read_model.record(nbytes // 3, 0.030)
        assert w.hits.slow([(1, 3)], 3), "a slow tier's hit stayed in the step"
        w.engine.stack.tiers[1].read_model = type(w.engine.stack.tiers[1].read_model)()
        for _ in range(4):
            w.engine.stack.tiers[1].read_model.record(nbytes, 0.0004)
            w.engine.stack.tiers[1].read_model.record(nbytes // 3, 0.0002)
        assert not w.hits.slow([(1, 3)], 3), "a fast tier's hit left the step"
        assert not w.hits.slow([(1, 3)], 0), "nothing to load is never slow"
    finally:
        w.close()


def test_worker_before_registration_moves_nothing_and_picks_one_transfers_object(tmp_path):
    """Until vLLM registers its KV caches the worker has no engine: every call is a
    no-op, and a load (which no lookup could have planned) is reported failed, so vLLM
    recomputes instead of trusting blocks nothing wrote. Registration then builds the
    one transfers object for the layout: dense here, with the strategies the settings
    ask for."""
    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata
    from lmcache_connector.options import load_settings
    from lmcache_connector.transfers.chunks import DenseTransfers
    from lmcache_connector.worker import WorkerSide

    settings = load_settings(
        {
            "chunk_size": 16,
            "backends": [{"name": "local_cpu", "max_size": "64MiB"}],
            "connector": {"async_saves": True, "async_loads": False},
        }
    )
    w = WorkerSide(settings, model_id="m", block_size=16, rank=0, world_size=1, lookup_address=None)
    step = LMCacheConnectorMetadata(
        chunk_size=16,
        loads=[ChunkTransfer("L", [b"a" * 16], 0, [16], [2])],
        saves=[ChunkTransfer("S", [b"b" * 16], 0, [16], [3])],
        step_tokens=16,
    )
    w.step_started(step)
    w.start_load_kv(step)
    w.wait_for_save(step)
    assert w.get_block_ids_with_load_errors() == {2}
    assert w.take_finished_loads() == (set(), set()) and w.take_finished_saves({"S"}) == set()
    assert w.engine is None and w.saves is None and w.stats()["saved_tokens"] == 0
    w.register_kv_caches({f"l{i}": torch.zeros(16, 2, 16, 16) for i in range(2)})
    try:
        assert isinstance(w.transfers, DenseTransfers) and w.saves is not None and w.loads is None and w.pipeline is None
        w.step_started(step)
        w.wait_for_save(step)
        w.saves.drain()
        assert w.engine is not None and w.engine.lookup_hashes([b"b" * 16]) == 1
    finally:
        w.close()


@pytest.mark.parametrize("ops", [False, True], ids=["torch", "lmcache_cuda-ops"])
def test_batched_transfers_copy_what_chunk_by_chunk_copies_do(tmp_path, ops):
    """The worker's GPU path (a transfer's chunks gathered and scattered together
    through layout.copy_many, waited for once) run on CPU, also through lmcache_cuda's
    ops (the kernels' staging and 2-D DMA plan, on its reference): the KV loaded into
    other blocks equals what the chunk-by-chunk path loads, buffers all come back."""
    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    results = {}
    for batched in (False, True):
        w = _worker(tmp_path)
        try:
            tr = w.transfers
            tr.batched = batched
            if ops:
                lmcache_cuda_ops = pytest.importorskip("lmcache_cuda.ops")
                tr.layout._ops = lmcache_cuda_ops
            hashes = [bytes([i]) * 16 for i in range(3)]
            save = LMCacheConnectorMetadata(
                chunk_size=16, saves=[ChunkTransfer("R", hashes, 0, [16, 32, 40], [3, 4, 5])], step_tokens=40
            )
            w.step_started(save)
            w.start_load_kv(save)
            w.wait_for_save(save)
            assert w.engine.lookup_hashes(hashes) == 3
            free = w.engine.pool.free_bytes
            load = LMCacheConnectorMetadata(
                chunk_size=16, loads=[ChunkTransfer("Q", hashes, 0, [16, 32, 40], [9, 10, 11], write_from=16)]
            )
            w.step_started(load)
            w.start_load_kv(load)
            w.wait_for_save(load)
            assert w.engine.pool.free_bytes == free, "a load's pool buffer was not given back"
            results[batched] = [t.clone() for t in tr.layout.layers]
        finally:
            w.close()
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)
    # the control: the loads wrote the saved KV (blocks 4-5 into 10-11; block 9 is below write_from)
    layer = results[True][0]
    assert torch.equal(layer[10:12], layer[4:6]) and not torch.equal(layer[9], layer[3])


def test_a_lookup_waits_for_a_background_save_of_its_chunks(tmp_path):
    """async_saves: a lookup of chunks still in a queued save waits for it (bounded) and
    hits; without a pending save it answers at once; a stuck save bounds the wait, and
    the answer then says the save is still running (the scheduler asks again later)."""
    import threading
    import time

    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    w = _worker(tmp_path, connector={"async_saves": True})
    gate = threading.Event()
    real = w.saves._save
    w.saves._save = lambda t, meta: (gate.wait(10), real(t, meta))
    try:
        hashes = [bytes([9, i]) * 8 for i in range(2)]
        step = LMCacheConnectorMetadata(chunk_size=16, saves=[ChunkTransfer("R", hashes, 0, [16, 32], [3, 4])], step_tokens=32)
        w.step_started(step)
        w.start_load_kv(step)
        w.wait_for_save(step)
        t0 = time.monotonic()
        # the save is stuck: a miss after the bounded wait, flagged as still saving
        assert w._lookup(hashes, None) == LookupAnswer(0, saving=True)
        waited = time.monotonic() - t0
        assert 0.08 <= waited < 2, waited
        threading.Timer(0.03, gate.set).start()
        assert w._lookup(hashes, None) == LookupAnswer(2)  # released while the lookup waits: a hit, saved
        t0 = time.monotonic()
        assert w._lookup([b"\x07" * 16], None) == MISS and time.monotonic() - t0 < 0.05  # nothing pending: at once
    finally:
        gate.set()
        w.close()


def test_save_progress_and_forgotten_requests():
    """The worker's SaveProgress (done transfers per request) and the scheduler's
    freed_early list: a forgotten request is never reported in finished_sending (the
    control: one not forgotten is); ranks aggregate to the minimum."""
    import threading

    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata, SaveProgress
    from lmcache_connector.transfers.async_saves import SaveQueue

    q = SaveQueue(lambda t, meta: None)
    try:
        meta = LMCacheConnectorMetadata(chunk_size=16)
        q.submit(meta, [ChunkTransfer("A", [b"a" * 16], 0, [16], [1]), ChunkTransfer("B", [b"b" * 16], 0, [16], [2])])
        q.submit(meta, [ChunkTransfer("A", [b"c" * 16], 1, [32], [1, 3])])
        q._join()
        assert q.progress() == {"A": 2, "B": 1}
        q.forget(["A"])
        assert q.progress() == {"B": 1}
        assert q.finished({"A", "B"}) == {"B"}  # A was freed at once by the scheduler: not reported
        assert q.progress() == {} and q.finished(set()) == set()
    finally:
        q.close()
    a, b = SaveProgress({"A": 2, "B": 1, "C": 4}), SaveProgress({"A": 1, "B": 3})
    assert a.aggregate(b).done == {"A": 1, "B": 1}  # C: one rank has no word of it
    assert threading.active_count() >= 1


@pytest.mark.parametrize("layerwise", [True, False])
def test_layerwise_saves_with_background_saves_count_as_done(tmp_path, layerwise):
    """With layerwise on, the layer pipeline stores a step's saves itself; the save
    queue must count them done, or a finished request is never reported in
    finished_sending and vLLM holds its blocks for ever. The same step without the
    pipeline (the control) goes through the queue."""
    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    w = _worker(tmp_path, connector={"async_saves": True, "layerwise": layerwise})
    try:
        assert (w.transfers.pipeline is not None) is layerwise
        hashes = [b"a" * 16, b"b" * 16]
        step = LMCacheConnectorMetadata(chunk_size=16, saves=[ChunkTransfer("R", hashes, 0, [16, 32], [3, 4])], step_tokens=32)
        w.step_started(step)
        w.start_load_kv(step)
        for name in ("l0", "l1"):
            w.wait_for_layer_load(name)
            w.save_kv_layer(name, step)
        w.wait_for_save(step)
        w.saves.drain()
        assert w.engine.lookup_hashes(hashes) == 2  # both chunks stored, either way
        assert w.saves.progress() == {"R": 1}  # the scheduler may free its blocks at once
        w.step_started(LMCacheConnectorMetadata(chunk_size=16))
        assert w.take_finished_saves({"R"}) == {"R"}  # or, held, reported once
        assert w.take_finished_saves(set()) == set()
    finally:
        w.close()


def test_scheduler_frees_a_finished_request_at_once_when_its_saves_are_done():
    from lmcache_connector.scheduler import _Req
    from lmcache_connector.options import RequestOptions

    s = _sched(connector={"async_saves": True})
    assert s.async_saves

    def req(rid, planned):
        return _Req(rid, 10, b"", {}, [], None, True, RequestOptions(), saves_planned=planned)

    s.saves_progress({"R1": 2, "R2": 1})
    assert s._delay_free(req("R1", 2)) is False  # both of its transfers done: freed now
    assert s._delay_free(req("R2", 2)) is True  # one still pending: held (the control)
    assert s._delay_free(req("R3", 1)) is True  # no word from the workers: held
    assert (s.freed_early, s.held_requests) == (1, 2)
    from types import SimpleNamespace

    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]), preempted_req_ids=[])
    s._step_work = lambda so, meta: None
    meta = s.build_connector_meta(so)
    assert meta.freed_early == ["R1"]
    assert s.build_connector_meta(so).freed_early == []  # named once


def test_retention_hints_are_parsed_and_reach_the_cpu_tier(tmp_path):
    """lmcache.retention_seconds / lmcache.priority in kv_transfer_params: parsed with
    the other per-request options (a bad value serves the request without the cache),
    sent with the step that saves or loads the request's chunks, and retained by the
    worker's CPU tier; a step without the hint retains nothing (control)."""
    from lmcache_connector.options import parse_request_options
    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    ok = parse_request_options({"lmcache.retention_seconds": 600, "lmcache.priority": 7})
    assert ok.retention == (600.0, 7) and ok.problem is None
    assert parse_request_options({}).retention is None
    for bad in (
        {"lmcache.retention_seconds": 0},
        {"lmcache.retention_seconds": -5},
        {"lmcache.retention_seconds": "600"},
        {"lmcache.retention_seconds": True},
        {"lmcache.retention_seconds": 1e12},
        {"lmcache.retention_seconds": 60, "lmcache.priority": 100},
        {"lmcache.retention_seconds": 60, "lmcache.priority": 1.5},
        {"lmcache.priority": 3},
    ):
        got = parse_request_options(bad, "r")
        assert got.problem and got.skip_save and got.skip_load, bad
    w = _worker(tmp_path)
    try:
        tier = w.engine.tiers[0]
        plain = LMCacheConnectorMetadata(chunk_size=16, saves=[ChunkTransfer("P", [b"p" * 16], 0, [16], [3])], step_tokens=16)
        w.step_started(plain)
        w.wait_for_save(plain)
        assert tier.stats().extra["retained"] == 0  # control
        kept = LMCacheConnectorMetadata(
            chunk_size=16, saves=[ChunkTransfer("K", [b"k" * 16], 0, [16], [4])], step_tokens=16, retain={"K": (600.0, 7)}
        )
        w.step_started(kept)
        w.wait_for_save(kept)
        assert tier.stats().extra["retained"] == 1
        assert w.counters()[f"tier_retained_bytes/{tier.name}"] > 0
    finally:
        w.close()


def test_every_end_of_a_request_releases_its_pins_once(tmp_path):
    """A lookup pins a request's hit under its id (prepare); the worker releases the
    pins once wherever the request's load ends: loaded in the step, failed in the
    step (its chunk gone), loaded on the load thread, or never loaded (finished,
    aborted or preempted first: the plan's ``unpins``). Control: between the lookup
    and that end the pins are held."""
    from collections import Counter

    from lmcache_connector.protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata

    w = _worker(tmp_path, connector={"async_loads": True})
    released: Counter[str] = Counter()
    real = w.engine.pins.release
    w.engine.pins.release = lambda pin_id: (released.update([pin_id]), real(pin_id))[1]
    try:
        data = torch.zeros(w.hits.chunk_shape, dtype=w.hits.chunk_dtype)
        h = {r: r.encode() * 16 for r in "ABCD"}
        for r in "ABCD":
            assert w.engine.store_hashes([h[r]], [data]) == 1
            assert w.hits.lookup([h[r]], r).chunks == 1
        assert w.engine.pins.ids() == set("ABCD")  # control: held until each request's end
        assert released == Counter(), "a lookup released pins it had just taken"
        w.engine.tiers[0].remove(w.engine.keys([h["B"]])[0])  # B's chunk is gone: its load fails
        step = LMCacheConnectorMetadata(
            chunk_size=16,
            loads=[
                ChunkTransfer("A", [h["A"]], 0, [16], [9]),
                ChunkTransfer("B", [h["B"]], 0, [16], [10]),
                ChunkTransfer("D", [h["D"]], 0, [16], [11], async_load=True),
            ],
            unpins=["C"],
        )
        w.step_started(step)
        w.start_load_kv(step)
        assert w.loads is not None
        w.loads.drain()
        assert w.get_block_ids_with_load_errors() == {10}, "B's load did not fail (the failed path was not taken)"
        assert w.engine.pins.ids() == set()
        assert released == Counter("ABCD"), released
    finally:
        w.close()


def test_stats_deltas_survive_a_missing_report_and_start_tier_series_at_zero():
    """A tier whose stats failed for a step is left out of that report: its next one
    must be an increment, not its whole total again (errors 5, gap, 5 counted 10; a
    released quarantine stuck at 1). A tier's first report, all zeros, still creates
    its series (reported at 0). Scheduler-side counters at 0 stay out (the control)."""
    from lmcache_connector.protocol.stats import DeltaReporter, LMCacheConnectorStats

    r = DeltaReporter()
    assert r.delta({"tier_errors/s3": 0, "tier_quarantined/s3": 0, "lookups": 0}) == {
        "tier_errors/s3": 0,
        "tier_quarantined/s3": 0,
    }
    assert r.delta({"tier_errors/s3": 5, "tier_quarantined/s3": 1, "lookups": 2}) == {
        "tier_errors/s3": 5,
        "tier_quarantined/s3": 1,
        "lookups": 2,
    }
    assert r.delta({"lookups": 2}) == {}  # the tier's stats failed this step
    assert r.delta({"tier_errors/s3": 5, "tier_quarantined/s3": 1, "lookups": 3}) == {"lookups": 1}
    assert r.delta({"tier_errors/s3": 5, "tier_quarantined/s3": 0, "lookups": 3}) == {"tier_quarantined/s3": -1}
    assert not LMCacheConnectorStats(data={"tier_errors/s3": 0}).is_empty()  # a first report reaches observe
    assert LMCacheConnectorStats(data={}).is_empty()
