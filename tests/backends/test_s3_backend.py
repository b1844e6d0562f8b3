"""The s3 tier against a real S3 endpoint (moto on loopback): plugin discovery, config
errors, batched lookups (requests counted at the client), large chunks, corrupt
objects, credentials never logged, and startup errors for a missing bucket or
wrong/missing credentials."""

from __future__ import annotations

import logging
import sys
import threading
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import SECRET_KEY, MotoS3, s3_bucket, s3_server  # noqa: E402,F401 - fixtures

from lmcache_backend_s3 import S3Backend, create_s3_backend  # noqa: E402
from lmcache_core.backend import BackendError  # noqa: E402
from lmcache_core.config import ConfigError, load_config  # noqa: E402
from lmcache_core.engine import CacheEngine  # noqa: E402
from lmcache_core.keys import KeyNamespace  # noqa: E402
from lmcache_core.plugins import PluginManager  # noqa: E402
from lmcache_core.serde import encode, RawCodec  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402


class RequestLog:
    """Counts HTTP requests a boto3 client sends, per operation, and the peak number
    in flight at once (so a test can tell parallel requests from sequential ones)."""

    def __init__(self, client: Any) -> None:
        self.ops: Counter[str] = Counter()
        self.inflight = 0
        self.peak = 0
        self._lock = threading.Lock()
        client.meta.events.register("before-send.s3", self._send)
        for ev in ("after-call.s3", "after-call-error.s3"):
            client.meta.events.register(ev, self._done)

    def _send(self, event_name: str, **_: Any) -> None:
        with self._lock:
            self.ops[event_name.rsplit(".", 1)[-1]] += 1
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)

    def _done(self, **_: Any) -> None:
        with self._lock:
            self.inflight -= 1

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()
            self.peak = self.inflight = 0


def make(server: MotoS3, bucket: str, **options: Any) -> S3Backend:
    return create_s3_backend(server.options(bucket, **options), make_context())


@pytest.fixture
def backend(s3_server: MotoS3, s3_bucket: str) -> Iterator[S3Backend]:
    b = make(s3_server, s3_bucket)
    yield b
    b.close()


# -- plugin and config ------------------------------------------------------------------
def test_plugin_is_found_through_its_entry_point() -> None:
    info = PluginManager().backends()["s3"]
    assert info.origin.distribution == "lmcache-backend-s3"
    assert info.load_factory() is create_s3_backend


def test_engine_builds_the_s3_tier_from_config(s3_server: MotoS3, s3_bucket: str) -> None:
    cfg = load_config(
        env={},
        overrides={"chunk_size": 16, "backends": [{"name": "local_cpu", "max_size": "16MiB"}, s3_server.section(s3_bucket)]},
    )
    with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as engine:
        assert [t.name for t in engine.tiers] == ["local_cpu", "s3"]
        assert isinstance(engine.tiers[1], S3Backend)


@pytest.mark.parametrize(
    "option, value, expect",
    [
        ("max_concurency", 4, "backends[1].max_concurency: unknown key"),
        ("bucket", "Not_A_Bucket!", "backends[1].bucket"),
        ("multipart_chunksize", "1MiB", "at least 5MiB"),
        ("endpoint_url", "localhost:9000", "backends[1].endpoint_url"),
        ("read_timeout_s", 0, "backends[1].read_timeout_s"),
        ("addressing_style", "sideways", "backends[1].addressing_style"),
        ("range_chunksize", "lots", "backends[1].range_chunksize"),
    ],
)
def test_config_errors_name_key_path_and_source(s3_server: MotoS3, s3_bucket: str, option: str, value: Any, expect: str) -> None:
    section = {**s3_server.section(s3_bucket), option: value}
    cfg = load_config(env={}, overrides={"backends": [{"name": "local_cpu"}, section]})
    with pytest.raises(ConfigError) as err:
        CacheEngine(cfg, namespace=KeyNamespace(model="m"))
    assert expect in str(err.value)
    assert "programmatic override" in str(err.value)


# -- batched lookups -----------------------------------------------------------------
def test_contains_over_128_chunks_is_parallel_and_cached(s3_server: MotoS3, s3_bucket: str) -> None:
    writer = make(s3_server, s3_bucket, prefix="batch")
    keys = [random_key() for _ in range(128)]
    for k in keys:
        assert writer.put(k, random_chunk(shape=(4, 16)))
    writer.close()

    reader = make(s3_server, s3_bucket, prefix="batch", max_concurrency=16)  # empty presence cache
    log = RequestLog(reader.client)
    try:
        assert reader.contains(keys) == 128
        assert log.ops["HeadObject"] == 128 and log.total == 128  # one HEAD per unknown key, nothing else
        assert log.peak > 1, "HEADs went out one at a time"
        log.reset()
        assert reader.contains(keys) == 128
        assert log.total == 0  # known-present keys cost no request
        # A miss in the middle: the count stops there, and at most one wave past it is asked.
        fresh = make(s3_server, s3_bucket, prefix="batch", max_concurrency=16)
        flog = RequestLog(fresh.client)
        gap = keys[:40] + [random_key()] + keys[40:]
        assert fresh.contains(gap) == 40
        assert flog.total <= 41 + 2 * 16  # the HEADs up to the miss, plus at most one window behind it
        fresh.close()
    finally:
        reader.close()


def test_put_of_a_chunk_already_in_the_bucket_uploads_nothing(s3_server: MotoS3, s3_bucket: str) -> None:
    key, data = random_key(), random_chunk()
    a, b = make(s3_server, s3_bucket), make(s3_server, s3_bucket)
    try:
        assert a.put(key, data)
        log = RequestLog(b.client)
        assert b.put(key, data)
        assert log.ops == Counter({"HeadObject": 1})
    finally:
        a.close()
        b.close()


# -- large chunks --------------------------------------------------------------------
def test_large_chunk_uses_multipart_upload_and_ranged_gets(s3_server: MotoS3, s3_bucket: str) -> None:
    b = make(
        s3_server,
        s3_bucket,
        multipart_threshold="6MiB",
        multipart_chunksize="5MiB",
        range_chunksize="2MiB",
        max_concurrency=4,
    )
    log = RequestLog(b.client)
    try:
        key = random_key()
        data = torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8)
        assert b.put(key, data)
        assert log.ops["CreateMultipartUpload"] == 1
        assert log.ops["UploadPart"] == 3  # 12MiB + header in 5MiB parts
        assert log.ops["CompleteMultipartUpload"] == 1
        assert log.ops["PutObject"] == 0
        log.reset()
        fresh = make(s3_server, s3_bucket, range_chunksize="2MiB", max_concurrency=4)
        flog = RequestLog(fresh.client)
        out = torch.zeros_like(data)
        assert fresh.get(key, out)
        assert torch.equal(out, data)
        assert flog.ops["GetObject"] == 7  # ceil((12MiB + header) / 2MiB)
        fresh.close()
    finally:
        b.close()


def test_object_larger_than_any_frame_for_out_is_a_miss_without_reading_it(backend: S3Backend, s3_server: MotoS3) -> None:
    key = random_key()
    big = torch.randint(0, 256, (2**20,), dtype=torch.uint8)
    assert backend.put(key, big)
    assert backend.get(key, torch.empty(16, dtype=torch.uint8)) is False


# -- corrupt objects -----------------------------------------------------------------
def _overwrite(server: MotoS3, bucket: str, backend: S3Backend, key: Any, body: bytes) -> None:
    server.client().put_object(Bucket=bucket, Key=backend.cfg.object_name(key.to_str()), Body=body)


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "garbage", "other_key", "empty", "huge_header_len"])
def test_corrupt_object_is_a_miss(backend: S3Backend, s3_server: MotoS3, s3_bucket: str, damage: str) -> None:
    key, data = random_key(), random_chunk(shape=(8, 64))
    frame = bytearray(encode(key, data, RawCodec()))
    if damage == "flip_payload_byte":
        frame[-5] ^= 0x40
    elif damage == "truncate":
        frame = frame[:-7]
    elif damage == "garbage":
        frame = bytearray(b"\x00garbage" * 50)
    elif damage == "other_key":
        frame = bytearray(encode(random_key(), data, RawCodec()))
    elif damage == "empty":
        frame = bytearray()
    elif damage == "huge_header_len":
        frame[:8] = (2**62).to_bytes(8, "little")
    _overwrite(s3_server, s3_bucket, backend, key, bytes(frame))
    out = torch.zeros_like(data)
    assert backend.get(key, out) is False
    assert backend.stats().extra["corrupt"] == 1


def test_corrupt_object_is_deleted_when_configured(s3_server: MotoS3, s3_bucket: str) -> None:
    b = make(s3_server, s3_bucket, delete_corrupt=True)
    try:
        key, data = random_key(), random_chunk(shape=(8, 8))
        assert b.put(key, data)
        _overwrite(s3_server, s3_bucket, b, key, b"not a frame")
        assert b.get(key, torch.empty_like(data)) is False
        assert b.contains([key]) == 0
    finally:
        b.close()


def test_wrong_shape_get_keeps_the_object(backend: S3Backend) -> None:
    key, data = random_key(), random_chunk(shape=(8, 8))
    assert backend.put(key, data)
    assert backend.get(key, torch.empty(4, 8, dtype=torch.float16)) is False
    assert backend.stats().extra["corrupt"] == 0
    out = torch.empty_like(data)
    assert backend.get(key, out) and torch.equal(out, data)


# -- credentials ---------------------------------------------------------------------
def test_debug_log_never_contains_the_secret_key(s3_server: MotoS3, s3_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        b = make(s3_server, s3_bucket)
        key, data = random_key(), random_chunk(shape=(4, 4))
        assert b.put(key, data)
        assert b.get(key, torch.empty_like(data))
        assert b.contains([key, random_key()]) == 1
        assert b.get(random_key(), torch.empty_like(data)) is False
        logging.getLogger("test").debug("%r %r", b, b.stats())
        b.close()
    assert len(caplog.records) > 20, "botocore's DEBUG logging was not captured"
    assert SECRET_KEY not in caplog.text


def test_missing_bucket_fails_at_startup_naming_bucket_and_endpoint(s3_server: MotoS3) -> None:
    with pytest.raises(ConfigError) as err:
        create_s3_backend(s3_server.options("no-such-bucket-lmc"), make_context(key_path="backends[1]"))
    msg = str(err.value)
    assert "backends[1].bucket" in msg and "'no-such-bucket-lmc'" in msg
    assert s3_server.endpoint in msg and "does not exist" in msg


@pytest.fixture
def moto_auth(s3_server: MotoS3) -> Iterator[None]:
    """Make moto check credentials (it accepts anything by default); restore after."""

    def set_count(value: str) -> None:
        req = urllib.request.Request(
            f"{s3_server.endpoint}/moto-api/reset-auth",
            data=value.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200

    set_count("0")
    try:
        yield
    finally:
        set_count("inf")


def test_wrong_credentials_fail_at_startup_with_one_clear_error(s3_server: MotoS3, s3_bucket: str, moto_auth: None) -> None:
    with pytest.raises(BackendError) as err:
        make(s3_server, s3_bucket)
    msg = str(err.value)
    assert f"'{s3_bucket}'" in msg and s3_server.endpoint in msg
    assert "access denied" in msg and "credentials" in msg
    assert SECRET_KEY not in msg


def test_no_credentials_fail_at_startup_with_what_to_set(
    s3_server: MotoS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(BackendError) as err:
        make(s3_server, s3_bucket)
    assert "no usable AWS credentials" in str(err.value) and "AWS_PROFILE" in str(err.value)


def test_unknown_profile_is_a_config_error(s3_server: MotoS3, s3_bucket: str) -> None:
    with pytest.raises(ConfigError) as err:
        make(s3_server, s3_bucket, profile="nope-lmc")
    assert "backends[0].profile" in str(err.value)
