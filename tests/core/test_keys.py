"""Chunk keys are deterministic (the same in processes with different hash seeds),
namespaced (every namespace field, the salt included, changes them; so do tags and
extras), chained (a changed token changes its chunk's key and every later one, never
an earlier one; a chain resumed midway gives the same hashes) and parseable (the
canonical string round-trips; malformed strings, wrong lengths, bad tokens and a bad
chunk size are refused)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_core.keys import ChunkKey, KeyNamespace, chain_seed, chunk_hashes, leading_part_keys

CS = 16
NS = KeyNamespace(model="org/model-7b", layout="block:cpu:bs16", dtype="bfloat16", world_size=2, rank=1, salt="s")

_SCRIPT = """
import json
from lmcache_core.keys import KeyNamespace, chain_seed, chunk_hashes
ns = KeyNamespace(model="org/model-7b", layout="block:cpu:bs16", dtype="bfloat16", world_size=2, rank=1, salt="s")
hs = chunk_hashes(list(range(1000, 1100)), 16, seed=chain_seed({"user": "a", "lora": "x"}), extras={2: b"img"})
print(json.dumps({"keys": [str(k) for k in ns.keys(hs)], "hash_of_str": hash("lmcache")}))
"""


def _keys_in_process(seed: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_keys_are_identical_across_processes_with_different_hash_seeds() -> None:
    a, b = _keys_in_process("1"), _keys_in_process("2")
    assert a["hash_of_str"] != b["hash_of_str"], "the two interpreters should hash strings differently"
    assert len(a["keys"]) == 6
    assert a["keys"] == b["keys"]
    here = chunk_hashes(list(range(1000, 1100)), 16, seed=chain_seed({"lora": "x", "user": "a"}), extras={2: b"img"})
    assert a["keys"] == [str(k) for k in NS.keys(here)]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "org/model-8b"},
        {"layout": "token:cuda"},
        {"dtype": "float16"},
        {"rank": 0},
        {"world_size": 4},
        {"salt": "tenant-b"},
        {"salt": None},
    ],
)
def test_every_namespace_field_changes_the_key(change: dict[str, object]) -> None:
    h = chunk_hashes(list(range(CS)), CS)[0]
    other = dataclasses.replace(NS, **change)
    assert other.key(h) != NS.key(h)
    assert str(other.key(h)) != str(NS.key(h))
    assert dataclasses.replace(NS).key(h) == NS.key(h)


def test_tags_change_the_whole_chain_and_order_does_not_matter() -> None:
    toks = list(range(4 * CS))
    plain = chunk_hashes(toks, CS)
    tagged = chunk_hashes(toks, CS, seed=chain_seed({"user": "a"}))
    assert all(x != y for x, y in zip(plain, tagged))
    assert chunk_hashes(toks, CS, seed=chain_seed({"user": "b"})) != tagged
    assert chain_seed({"a": "1", "b": "2"}) == chain_seed({"b": "2", "a": "1"})
    assert chain_seed({}) == chain_seed(None)


def test_extras_change_their_chunk_and_all_later_ones() -> None:
    toks = list(range(6 * CS))
    base = chunk_hashes(toks, CS)
    with_img = chunk_hashes(toks, CS, extras={2: b"image-hash-1"})
    other_img = chunk_hashes(toks, CS, extras={2: b"image-hash-2"})
    assert with_img[:2] == base[:2]
    assert all(x != y for x, y in zip(with_img[2:], base[2:]))
    assert all(x != y for x, y in zip(with_img[2:], other_img[2:]))


def test_canonical_string_round_trips() -> None:
    for h in chunk_hashes(list(range(3 * CS)), CS):
        key = NS.key(h)
        text = str(key)
        assert text == key.to_str()
        assert text.startswith("v1-") and text == text.lower()
        assert ChunkKey.parse(text) == key


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "v1",
        "v2-" + "0" * 32 + "-" + "0" * 32,
        "v1-" + "0" * 32,
        "v1-" + "0" * 31 + "-" + "0" * 32,
        "v1-" + "0" * 32 + "-" + "0" * 34,
        "v1-" + "A" * 32 + "-" + "0" * 32,
        "v1-" + "g" * 32 + "-" + "0" * 32,
        "v1-" + "0" * 32 + "-" + "0" * 32 + "-x",
        "v1- " + "0" * 31 + "-" + "0" * 32,
        "v1-" + "0" * 32 + "-" + "0" * 32 + "\n",
    ],
)
def test_parse_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="not a chunk key"):
        ChunkKey.parse(bad)


def test_chunk_key_rejects_wrong_lengths() -> None:
    with pytest.raises(ValueError):
        ChunkKey(b"\0" * 15, b"\0" * 16)
    with pytest.raises(ValueError):
        ChunkKey(b"\0" * 16, b"\0" * 17)


def test_chunk_key_is_a_value_hashed_and_compared_in_c() -> None:
    import copy
    import pickle

    from lmcache_core.eviction import _MIX, _sample_point

    ns, h = b"n" * 16, b"h" * 16
    key = ChunkKey(ns, h)
    assert (key.namespace, key.chunk_hash) == (ns, h)
    assert key == ChunkKey(bytes(ns), bytes(h)) and hash(key) == hash(ChunkKey(ns, h))
    assert key != ChunkKey(b"m" * 16, h) and key != ChunkKey(ns, b"g" * 16)  # both parts count
    assert {key: 1}[ChunkKey(ns, h)] == 1
    for copied in (pickle.loads(pickle.dumps(key)), copy.copy(key), copy.deepcopy(key)):
        assert type(copied) is ChunkKey and copied == key
    with pytest.raises(AttributeError):
        key.chunk_hash = b"x" * 16  # type: ignore[misc]
    # the hash and equality of the tuple underneath, no Python-level method per lookup
    assert ChunkKey.__hash__ is tuple.__hash__ and ChunkKey.__eq__ is tuple.__eq__
    # adaptive's shadows sample a key by its chunk hash alone (as before the tuple), at
    # the low 32 bits of its hash times _MIX; cutting the hash to 32 bits first gives
    # the same point for every hash, negative ones included
    m = 0xFFFFFFFF
    assert _sample_point(key) == hash(h) * _MIX & m and _sample_point(b"raw") == hash(b"raw") * _MIX & m
    for x in (-(2**63), -(2**32) - 1, -1, 0, 1, 2**32 + 5, 2**63 - 1, hash(h), -hash(h)):
        assert (x & m) * _MIX & m == x * _MIX & m


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=CS, max_size=8 * CS),
    st.data(),
)
def test_prefix_property(tokens: list[int], data: st.DataObject) -> None:
    base = chunk_hashes(tokens, CS)
    n_chunks = len(tokens) // CS
    assert len(base) == n_chunks
    i = data.draw(st.integers(0, n_chunks - 1), label="chunk")
    pos = data.draw(st.integers(i * CS, (i + 1) * CS - 1), label="token")
    changed = list(tokens)
    changed[pos] = (changed[pos] + 1) % 2**32
    after = chunk_hashes(changed, CS)
    assert after[:i] == base[:i]
    assert all(x != y for x, y in zip(after[i:], base[i:]))
    # A longer prompt sharing a prefix shares its leading hashes.
    extended = chunk_hashes(tokens + [7] * (2 * CS), CS)
    assert extended[:n_chunks] == base


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 10), st.integers(0, 9), st.integers(0, CS - 1))
def test_resuming_a_chain_gives_the_same_hashes(n_chunks: int, k: int, tail: int) -> None:
    k = min(k, n_chunks - 1)
    toks = np.arange(n_chunks * CS + tail, dtype=np.int64) * 7919 % 50_000
    full = chunk_hashes(toks, CS, include_partial=True)
    start = full[k - 1] if k > 0 else None
    resumed = chunk_hashes(toks, CS, start=start, first_chunk=k, include_partial=True)
    assert resumed == full[k:]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 4), st.integers(0, CS - 1), st.integers(1, CS - 1))
def test_leading_part_keys_are_the_partial_chunk_keys_of_the_cut_prompt(n_chunks: int, tail: int, count: int) -> None:
    """Each whole chunk's first ``count`` tokens get the key a prompt cut there has for
    its trailing partial chunk (extras and tags count as in chunk_hashes)."""
    toks = np.arange(n_chunks * CS + tail, dtype=np.int64) * 7919 % 50_000
    seed, extras = chain_seed({"user": "a"}), {1: b"img"}
    hashes = chunk_hashes(toks, CS, seed=seed, extras=extras)
    got = leading_part_keys(toks, CS, hashes, count, seed=seed, extras=extras)
    want = [chunk_hashes(toks[: i * CS + count], CS, seed=seed, extras=extras, include_partial=True)[-1] for i in range(n_chunks)]
    assert got == want and len(set(got) | set(hashes)) == len(got) + len(hashes)
    if n_chunks > 1:  # negative control: without the extras the chunk that has them changes
        assert leading_part_keys(toks, CS, hashes, count, seed=seed)[1] != got[1]
    with pytest.raises(ValueError):
        leading_part_keys(toks, CS, hashes, CS, seed=seed)


def test_partial_chunk_only_when_asked() -> None:
    toks = list(range(2 * CS + 5))
    assert len(chunk_hashes(toks, CS)) == 2
    with_partial = chunk_hashes(toks, CS, include_partial=True)
    assert len(with_partial) == 3 and with_partial[:2] == chunk_hashes(toks, CS)
    assert chunk_hashes(toks[:-1], CS, include_partial=True)[2] != with_partial[2]


def test_token_containers_agree() -> None:
    toks = [5, 9, 2**32 - 1] * CS
    ref = chunk_hashes(toks, CS)
    assert chunk_hashes(np.array(toks, dtype=np.uint32), CS) == ref
    assert chunk_hashes(np.array(toks, dtype=np.int64), CS) == ref
    assert chunk_hashes(array("L", toks) if array("L").itemsize >= 4 else array("Q", toks), CS) == ref
    assert chunk_hashes(tuple(toks), CS) == ref


@pytest.mark.parametrize(
    "bad",
    [[-1] * CS, [2**32] * CS, np.zeros(CS, dtype=np.float32), np.zeros((2, CS), dtype=np.int64)],
    ids=["negative", "too-big", "float", "2-D"],
)
def test_bad_tokens_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="token ids"):
        chunk_hashes(bad, CS)  # type: ignore[arg-type]


def test_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_hashes([1, 2, 3], 0)
