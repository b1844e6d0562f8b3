"""Sub-chunk hits without an engine of vLLM's: the hashes, the scheduler's index, the
lookup message that carries the offers (over a real ZMQ socket), and the worker's
check against a real CacheEngine with a CPU tier."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from lmcache_core import CacheEngine, KeyNamespace  # noqa: E402
from lmcache_core.config import load_config  # noqa: E402
from lmcache_core.keys import chain_seed, chunk_hashes, sub_chunk_hashes  # noqa: E402
from lmcache_core.plugins import PluginManager  # noqa: E402
from lmcache_core.testing.tokens import token_hashes  # noqa: E402
from lmcache_connector.features.hits import HitPlanner  # noqa: E402
from lmcache_connector.features.load_policy import PrefillModel  # noqa: E402
from lmcache_connector.protocol.lookup_ipc import LookupAnswer, LookupClient, LookupServer, _combine, decode_alts, encode_alts  # noqa: E402
from lmcache_connector.features.subchunks import SubChunkIndex  # noqa: E402

SEED = chain_seed()


def toks(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]


def test_sub_chunk_hashes_name_prefixes_only():
    a = toks(1, 64)
    b = a[:40] + toks(2, 24)  # shares 2 blocks of 16 and 8 tokens of the third
    ha, hb = sub_chunk_hashes(SEED, a, 16), sub_chunk_hashes(SEED, b, 16)
    assert len(ha) == 3  # 16, 32, 48: the whole chunk (64) is its own key
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    # the chain before, the extra bytes and the domain all count
    assert sub_chunk_hashes(chain_seed({"t": "x"}), a, 16)[0] != ha[0]
    assert sub_chunk_hashes(SEED, a, 16, extra=b"img")[0] != ha[0]
    assert ha[0] not in chunk_hashes(a[:16], 16, seed=SEED, include_partial=True)
    # a trailing partial chunk: every whole block of it, on request
    assert sub_chunk_hashes(SEED, a[:40], 16, count=40 // 16) == ha[:2]
    assert sub_chunk_hashes(SEED, a[:10], 16) == []


def test_index_offers_the_longest_shared_prefix_of_another_chunk():
    idx = SubChunkIndex(chunk_size=64, block_size=16, max_entries=6)
    a, b = toks(1, 64), toks(1, 40) + toks(3, 24)
    ha = chunk_hashes(a, 64, seed=SEED)[0]
    hb = chunk_hashes(b, 64, seed=SEED)[0]
    pa, pb = idx.prefixes(SEED, a), idx.prefixes(SEED, b)
    assert idx.candidate(pb, hb) is None  # empty index
    idx.remember(pa, ha)
    assert idx.candidate(pb, hb) == (ha, 32, 64)  # b shares two blocks of a's chunk (of 64 tokens)
    assert idx.candidate(pa, ha) is None  # a's own chunk is a plain hit, not an offer
    # bounded: the least recently remembered entries go first
    for s in range(2, 4):
        c = toks(10 + s, 64)
        idx.remember(idx.prefixes(SEED, c), chunk_hashes(c, 64, seed=SEED)[0])
    assert len(idx) == 6 and idx.candidate(pb, hb) is None
    assert not SubChunkIndex(chunk_size=128, block_size=128).useful


def test_hit_flags_and_offers_round_trip():
    for hit in (LookupAnswer(3), LookupAnswer(3, slow=True), LookupAnswer(3, tail=True), LookupAnswer(0, slow=True, tail=True)):
        assert LookupAnswer.decode(hit.encode()) == hit
    assert not LookupAnswer(0, slow=True).slow and LookupAnswer(0, slow=True, tail=True).slow
    alts = {0: b"a" * 16, 7: b"b" * 16}
    assert decode_alts(encode_alts(alts)) == alts
    assert decode_alts(b"x" * 19) is None
    # ranks: the offered chunk counts only if every rank holds it after the same hit
    assert _combine([LookupAnswer(2, tail=True), LookupAnswer(2, tail=True)]).tail
    assert not _combine([LookupAnswer(2, tail=True), LookupAnswer(1, tail=True)]).tail
    assert not _combine([LookupAnswer(2, tail=True), LookupAnswer(2)]).tail


def test_offers_travel_over_the_socket(tmp_path):
    seen = []

    def lookup(hashes, pin, alts=None):
        seen.append(alts)
        n = len(hashes) - 1
        return LookupAnswer(n, tail=bool(alts) and n in alts)

    addr = f"ipc://{tmp_path}/alts.ipc"
    server = LookupServer(addr, lookup)
    client = LookupClient([addr], timeout_s=2.0)
    try:
        plain = client.lookup([b"x" * 16] * 4, "r1")
        offered = client.lookup([b"x" * 16] * 4, "r2", {3: b"y" * 16})
        assert (plain.chunks, plain.tail) == (3, False)
        assert (offered.chunks, offered.tail) == (3, True)
        assert seen == [None, {3: b"y" * 16}]
    finally:
        client.close()
        server.close()


CS, SHAPE = 16, (2, 2, 16, 8)


@pytest.fixture
def planner():
    loaded = load_config(env={}, overrides={"chunk_size": CS, "backends": [{"name": "local_cpu", "max_size": "1MiB"}]})
    ns = KeyNamespace(model="subchunk-test", layout="test", dtype="float32")
    with CacheEngine(loaded, namespace=ns, plugins=PluginManager(load_entry_points=False)) as eng:
        yield (
            eng,
            HitPlanner(
                eng,
                chunk_size=CS,
                chunk_shape=SHAPE,
                chunk_dtype=torch.float32,
                load_policy="always",
                load_margin=0.2,
                prefill=PrefillModel(),
                boundary=False,
                background=False,
            ),
        )


def test_worker_checks_and_pins_the_offered_chunk(planner):
    eng, hits = planner
    a = toks(1, 3 * CS)
    ha = token_hashes(eng, a)
    eng.store_hashes(ha, [torch.randn(SHAPE) for _ in ha])
    other = b"\x01" * 16  # a chunk hash nobody stored
    got = hits.lookup(ha[:2] + [other], "r1", {2: ha[2]})
    assert (got.chunks, got.tail) == (2, True)
    assert eng.tiers[0].stats().extra["pinned"] == 3  # the hit and the offered chunk
    eng.pins.release("r1")
    # absent offer: the plain hit, pinned alone
    got = hits.lookup(ha[:2] + [other], "r2", {2: other})
    assert (got.chunks, got.tail) == (2, False)
    assert eng.tiers[0].stats().extra["pinned"] == 2
    eng.pins.release("r2")
    # an offer for a chunk the hit does not end at is not checked
    got = hits.lookup(ha, "r3", {1: ha[2]})
    assert (got.chunks, got.tail) == (3, False)
    eng.pins.release("r3")
    assert eng.stats()["lookups"] == 3  # one lookup each, the second probe uncounted
