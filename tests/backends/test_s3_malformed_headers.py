"""Frame headers checked through the s3 tier (moto on loopback): an object whose frame
header holds malformed numbers (``Infinity`` offsets, integers beyond 64 bits) is a
miss, never an exception; it is counted as corrupt and, with ``delete_corrupt``,
removed from the bucket; an object that declares a huge decompressed size is refused
from its header."""

from __future__ import annotations

import json
import os
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


def test_decompression_bomb_object_is_refused_before_decompression(s3_server: MotoS3, s3_bucket: str) -> None:
    """A decompression bomb through the s3 tier: an 8 MiB lz4 object whose header declares
    1.9 GiB (within lz4's 255x, valid checksum) is a miss in < 1 s with < 64 MiB
    allocated at peak during the get (tracemalloc: Python, lz4 and numpy buffers),
    the 8 MiB download included. Before the fix lz4 allocated the declared size."""
    import json as _json
    import time
    import tracemalloc

    from lmcache_core.serde import Lz4Codec, frame_header, frame_meta, payload_checksum

    b = create_s3_backend(s3_server.options(s3_bucket), make_context())
    try:
        key = random_key()
        out = torch.empty(4096, 1024, dtype=torch.float16)  # an 8 MiB chunk: the object is not too large
        payload = os.urandom(8 << 20)
        meta = frame_meta(key, torch.empty(0, dtype=torch.float16), Lz4Codec.name, 1900 << 20)
        meta["shape"] = _json.dumps([950 << 20])
        bomb = frame_header(meta, payload_checksum(meta, payload), len(payload)) + payload
        s3_server.client().put_object(Bucket=s3_bucket, Key=b.cfg.object_name(key.to_str()), Body=bomb)
        tracemalloc.start()
        try:
            t0 = time.perf_counter()
            assert b.get(key, out) is False
            elapsed = time.perf_counter() - t0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        print(_json.dumps({"s": elapsed, "peak_mib": peak / 2**20}))
        assert elapsed < 1.0 and peak < 64 << 20, (elapsed, peak)
    finally:
        b.close()
