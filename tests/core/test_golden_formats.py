"""Golden tests for the persisted formats: chunk keys and frames outlive the code that
wrote them (disk directories, S3 buckets, peers on another version). A change to the key
scheme (hash input, length encoding, namespace fields) or to the frame layout fails
here loudly; such a change must bump ``KEY_FORMAT_VERSION`` / ``FRAME_FORMAT``, come
with a migration note in docs/, and then regenerate these values on purpose.

The frame files under ``golden/`` were written by lmcache-core 0.1 (format
``lmcache-core/2``) and are checked in.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmcache_core import serde
from lmcache_core.keys import KEY_FORMAT_VERSION, ChunkKey, KeyNamespace, chain_seed, chunk_hashes

GOLDEN = Path(__file__).parent / "golden"
TOKENS = list(range(10, 30))
NS = KeyNamespace(model="golden-model", layout="vllm-0.32/block/v1/x", dtype="float32", world_size=2, rank=1, salt="s")


def test_key_format_version_is_pinned():
    assert KEY_FORMAT_VERSION == 1 and serde.FRAME_FORMAT == "lmcache-core/2"


def test_chunk_hashes_are_golden():
    assert [h.hex() for h in chunk_hashes(TOKENS, 8, include_partial=True)] == [
        "70bfe0c68aa6c77b90d3674e786b8066",
        "da5fa8d753ab9329556cff0c0054e5d6",
        "16fcd032353658e5482956f0054dfe50",  # the partial chunk (4 tokens)
    ]
    tagged = chunk_hashes(TOKENS, 8, seed=chain_seed({"tenant": "acme"}), extras={1: b"image:abc@8+4;"})
    assert [h.hex() for h in tagged] == ["c119d3c68545c4ba3c33be3c0f73584e", "4f0250dc73c7d30785be825cb4937023"]


def test_namespace_and_key_string_are_golden():
    assert NS.canonical() == (
        '{"dtype":"float32","layout":"vllm-0.32/block/v1/x","model":"golden-model","rank":1,"salt":"s","v":1,"world_size":2}'
    )
    assert NS.id.hex() == "db3479c5ea7f4a403b220a12aa3de42e"
    key = NS.key(bytes.fromhex("70bfe0c68aa6c77b90d3674e786b8066"))
    assert key.to_str() == "v1-db3479c5ea7f4a403b220a12aa3de42e-70bfe0c68aa6c77b90d3674e786b8066"
    assert ChunkKey.parse(key.to_str()) == key


def test_boundary_hash_is_golden():
    from lmcache_connector.layouts.groups import boundary_hash

    assert boundary_hash(bytes.fromhex("70bfe0c68aa6c77b90d3674e786b8066")).hex() == "84c32f7cf81618ed3b975cba2cc488fe"


def _key() -> ChunkKey:
    return NS.key(chunk_hashes(TOKENS, 8)[0])


def test_raw_frame_bytes_are_golden():
    golden = (GOLDEN / "frame_raw_v2.bin").read_bytes()
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert serde.encode(_key(), t, serde.RawCodec()) == golden
    out = torch.empty(2, 3, dtype=torch.float32)
    serde.decode(golden, {"raw": serde.RawCodec()}, expect_key=_key(), out=out)
    assert torch.equal(out, t)


def test_checked_in_lz4_frame_still_decodes():
    """lz4's output may differ between library versions, so only decoding is pinned."""
    golden = (GOLDEN / "frame_lz4_v2.bin").read_bytes()
    out = torch.empty(8, 8, dtype=torch.int32)
    serde.decode(golden, {"lz4": serde.Lz4Codec()}, expect_key=_key(), out=out)
    assert torch.equal(out, torch.arange(64, dtype=torch.int32).view(8, 8) % 5)


def test_golden_frames_reject_another_key():
    """Negative control: the checked-in frame is not accepted for a different key."""
    golden = (GOLDEN / "frame_raw_v2.bin").read_bytes()
    other = NS.key(chunk_hashes(TOKENS, 8)[1])
    decoded = serde.try_decode(golden, {"raw": serde.RawCodec()}, expect_key=other, out=torch.empty(2, 3))
    got, reason = decoded.tensor, decoded.reason
    assert got is None and reason
