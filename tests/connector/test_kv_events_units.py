"""KV-event translation without an engine: a chunk is announced in a tier once every
writing rank stored it, removed once (as soon as one rank evicts it), and only chunks
the scheduler saw being saved are announced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from lmcache_connector.kv_events import EventTranslator, LMCacheCoreKVEvents, TierEventBuffer  # noqa: E402
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
