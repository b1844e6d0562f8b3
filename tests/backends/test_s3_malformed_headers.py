"""Issue #12, finding 5 through the s3 tier (moto on loopback): an object whose frame
header holds malformed numbers (``Infinity`` offsets, integers beyond 64 bits) is a
miss, never an exception; it is counted as corrupt and, with ``delete_corrupt``,
removed from the bucket."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import MotoS3, s3_bucket, s3_server  # noqa: E402,F401 - fixtures

from lmcache_backend_s3 import create_s3_backend  # noqa: E402
from lmcache_core.serde import RawCodec, encode  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402


def _malformed(frame: bytes, offsets: str) -> bytes:
    (hlen,) = struct.unpack_from("<Q", frame)
    header = json.loads(frame[8 : 8 + hlen])
    text = json.dumps(header).replace(json.dumps(header["payload"]["data_offsets"]), offsets).encode()
    return struct.pack("<Q", len(text)) + text + frame[8 + hlen :]


@pytest.mark.parametrize("offsets", ["[0, Infinity]", "[NaN, 0]", f"[0, {2**70}]"])
def test_malformed_header_object_is_a_removed_miss(s3_server: MotoS3, s3_bucket: str, offsets: str) -> None:
    b = create_s3_backend(s3_server.options(s3_bucket, delete_corrupt=True), make_context())
    try:
        key, data = random_key(), random_chunk(shape=(8, 16))
        assert b.put(key, data)
        name = b.cfg.object_name(key.to_str())
        client = s3_server.client()
        client.put_object(Bucket=s3_bucket, Key=name, Body=_malformed(encode(key, data, RawCodec()), offsets))
        assert b.get(key, torch.empty_like(data)) is False  # a miss, no exception
        assert b.stats().extra["corrupt"] == 1
        listed = client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
        assert [o["Key"] for o in listed] == []  # the corrupt object was removed
    finally:
        b.close()
