"""KV-event translation without an engine: a chunk is announced in a tier once every
writing rank stored it, removed once (as soon as one rank evicts it), and only chunks
the scheduler saw being saved are announced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from lmcache_connector.protocol.kv_events import EventTranslator, LMCacheCoreKVEvents, TierEventBuffer  # noqa: E402
from lmcache_core.engine import TierEvent  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402

CS, BS = 4, 2


def _request(n_tokens: int) -> SimpleNamespace:
    toks = list(range(100, 100 + n_tokens))
    return SimpleNamespace(block_hashes=[bytes([i]) * 32 for i in range(n_tokens // BS)], all_token_ids=toks, lora_request=None)


def _batch(*events: tuple[int, str, str, bytes]) -> LMCacheCoreKVEvents:
    return LMCacheCoreKVEvents(list(events))


def test_stores_wait_for_every_rank_and_removal_is_announced_once():
    tr = EventTranslator(chunk_size=CS, hash_block_size=BS, writers=[0, 1])
    req = _request(8)
    h0, h1 = b"a" * 16, b"b" * 16
    tr.remember(req, 0, h0, 4)
    tr.remember(req, 1, h1, 8)
    tr.add(_batch((0, "stored", "local_cpu", h0), (0, "stored", "local_cpu", h1)))
    assert tr.take() == []  # rank 1 has not stored its shards yet
    tr.add(_batch((1, "stored", "local_cpu", h1), (1, "stored", "local_cpu", b"z" * 16)))
    (ev,) = tr.take()
    assert ev.medium == "lmcache:local_cpu" and ev.block_size == BS
    assert ev.token_ids == [104, 105, 106, 107]
    assert ev.parent_block_hash is not None and len(ev.block_hashes) == 2
    assert tr.unknown == 1  # a chunk this scheduler never saved is not announced
    tr.add(_batch((0, "evicted", "local_cpu", h1), (1, "evicted", "local_cpu", h1), (0, "evicted", "local_cpu", h0)))
    removed = tr.take()
    assert [type(e).__name__ for e in removed] == ["BlockRemoved"]  # h0 was never announced
    assert removed[0].block_hashes == ev.block_hashes and removed[0].medium == "lmcache:local_cpu"


def test_memory_is_bounded_and_partial_chunks_without_a_block_are_skipped():
    tr = EventTranslator(chunk_size=CS, hash_block_size=BS, writers=[0], max_chunks=2)
    req = _request(12)
    for c in range(3):
        tr.remember(req, c, bytes([c]) * 16, (c + 1) * CS)
    tr.remember(_request(5), 1, b"p" * 16, 5)  # tokens 4..5: no full vLLM block past 4
    tr.add(_batch(*[(0, "stored", "disk", bytes([c]) * 16) for c in range(3)]))
    assert [e.token_ids[0] for e in tr.take()] == [104, 108]  # chunk 0 forgotten, the partial never kept
    assert tr.unknown == 1


def test_worker_buffer_keeps_this_models_namespaces_and_is_bounded():
    ours, other = b"n" * 16, b"o" * 16
    buf = TierEventBuffer(1, [b"r" * 16, ours], maxlen=2)
    buf(TierEvent("stored", "disk", ChunkKey(other, b"x" * 16)))
    buf(TierEvent("stored", "disk", ChunkKey(ours, b"x" * 16)))
    buf(TierEvent("evicted", "disk", ChunkKey(b"r" * 16, b"y" * 16)))
    buf(TierEvent("evicted", "disk", ChunkKey(ours, b"z" * 16)))
    assert buf.take() == [(1, "stored", "disk", b"x" * 16), (0, "evicted", "disk", b"y" * 16)]
    assert buf.dropped == 1 and buf.take() == []


def _ext(req: SimpleNamespace, a: int, b: int) -> list:
    """Blocks ``a..b`` of ``req`` as vLLM's events name them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in req.block_hashes[a:b]]


def _hybrid(window: int = 6, state_mode: str = "align") -> list:
    from lmcache_connector.layouts.groups import FULL, STATE, WINDOW, GroupInfo
    from lmcache_connector.protocol.kv_events import EventGroup

    w = GroupInfo(0, WINDOW, BS, (), window=window)
    s = GroupInfo(1, STATE, BS, (), state_mode=state_mode)
    f = GroupInfo(2, FULL, BS, ())
    return [
        EventGroup(0, WINDOW, BS, "sliding_window", window, w),
        EventGroup(1, STATE, BS, "mamba", None, s),
        EventGroup(2, FULL, BS, "full_attention", None, f),
    ]


def test_hybrid_objects_are_announced_per_group_with_vllms_group_fields():
    tr = EventTranslator(chunk_size=CS, hash_block_size=BS, writers=[0], groups=_hybrid())
    req = _request(12)
    tr.remember(req, 1, b"c" * 16, 8)  # chunk 1: tokens 4..8 = blocks 2, 3
    tr.remember_boundary(req, b"B" * 16, 8)  # window 6 before token 8: blocks 1..3; state: block 3
    tr.add(_batch((0, "stored", "disk", b"c" * 16), (0, "stored", "disk", b"B" * 16)))
    by_group = {e.group_idx: e for e in tr.take()}
    assert set(by_group) == {0, 1, 2}
    full, window, state = by_group[2], by_group[0], by_group[1]
    assert (full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == ("full_attention", None)
    assert full.block_hashes == _ext(req, 2, 4) and full.parent_block_hash == _ext(req, 1, 1 + 1)[0]
    assert (window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == ("sliding_window", 6)
    assert window.block_hashes == _ext(req, 1, 4) and window.token_ids == list(range(102, 108))
    assert state.kv_cache_spec_kind == "mamba" and state.block_hashes == _ext(req, 3, 4)
    assert state.parent_block_hash == _ext(req, 2, 2 + 1)[0] and state.token_ids == [106, 107]
    assert {e.block_size for e in by_group.values()} == {BS}
    tr.add(_batch((0, "evicted", "disk", b"B" * 16)))
    assert sorted((e.group_idx, len(e.block_hashes)) for e in tr.take()) == [(0, 3), (1, 1)]


def test_shared_window_blocks_are_announced_once_and_removed_with_the_last_holder():
    tr = EventTranslator(chunk_size=CS, hash_block_size=BS, writers=[0], groups=_hybrid(window=6)[:1])
    req = _request(16)
    b8, b12 = b"8" * 16, b"C" * 16
    tr.remember_boundary(req, b8, 8)  # blocks 1, 2, 3
    tr.remember_boundary(req, b12, 12)  # blocks 3, 4, 5: block 3 shared
    tr.add(_batch((0, "stored", "local_cpu", b8), (0, "stored", "local_cpu", b12), (0, "stored", "disk", b12)))
    out = tr.take()
    assert [(e.medium, e.block_hashes) for e in out] == [
        ("lmcache:local_cpu", _ext(req, 1, 4)),
        ("lmcache:local_cpu", _ext(req, 4, 6)),  # block 3 already held in this tier
        ("lmcache:disk", _ext(req, 3, 6)),  # another tier counts apart
    ]
    assert out[1].parent_block_hash == _ext(req, 3, 3 + 1)[0] and out[1].token_ids == list(range(108, 112))
    tr.add(_batch((0, "evicted", "local_cpu", b8)))
    assert [e.block_hashes for e in tr.take()] == [_ext(req, 1, 3)]  # block 3 still held by b12
    tr.add(_batch((0, "evicted", "local_cpu", b12)))
    assert [e.block_hashes for e in tr.take()] == [_ext(req, 3, 6)]
    assert tr._held == {(("lmcache:disk"), 0, h): 1 for h in _ext(req, 3, 6)}


def test_states_vllm_has_no_hash_for_are_not_announced_and_memory_stays_bounded():
    # "none" mode (no prefix caching for the state group): vLLM names no block.
    tr = EventTranslator(chunk_size=CS, hash_block_size=BS, writers=[0], groups=_hybrid(state_mode="none")[1:2])
    tr.remember_boundary(_request(12), b"B" * 16, 8)
    tr.add(_batch((0, "stored", "disk", b"B" * 16)))
    assert tr.take() == [] and tr.unknown == 1
    # Forgotten objects give their window counts back (the count map stays bounded).
    tr = EventTranslator(chunk_size=CS, hash_block_size=BS, writers=[0], groups=_hybrid()[:1], max_chunks=1)
    req = _request(16)
    tr.remember_boundary(req, b"8" * 16, 8)
    tr.add(_batch((0, "stored", "disk", b"8" * 16)))
    assert len(tr.take()) == 1 and len(tr._held) == 3
    tr.remember_boundary(req, b"C" * 16, 12)  # pushes the first out of memory
    assert tr._held == {}
