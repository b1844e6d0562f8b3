"""The Redis, S3 and disk tiers sort their misses by ``serde``'s verdict: a frame of
another shape for the key is left in place and not counted as corrupt; a corrupt or
foreign one is counted. With ``delete_corrupt`` Redis and S3 delete only the corrupt
ones: a foreign frame (a codec not installed here, sealed with another key) may be
another reader's, so it stays (the disk tier drops what it cannot verify as its own).
These pin the cases where the kinds combine, each judged by the verdict alone (never
by re-parsing the frame): another shape *and* sealed with another deployment's key
(the caller cannot take it: wrong shape for Redis and S3, which keep it; on disk,
where a kept file must verify, dropped), and a Redis value longer than any frame for
the caller's chunk (judged from the prefix the tier read). Each case has a control
that is counted and removed: the same frame damaged. Real servers on loopback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixtures
from s3_server import MotoS3, s3_bucket, s3_server  # noqa: E402,F401 - fixtures

from lmcache_backend_disk import create_disk_backend  # noqa: E402
from lmcache_backend_redis import create_redis_backend  # noqa: E402
from lmcache_backend_s3 import create_s3_backend  # noqa: E402
from lmcache_core.backend import StorageBackend  # noqa: E402
from lmcache_core.serde import FrameSeal, SealedCodec, encode  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

SECRET = "this-deployment-secret-32-bytes!"
THEIRS = "another-deployment-secret-32-by!"
SHAPE = (8, 64)
OTHER_SHAPE = (4, 64)


def theirs(key: Any, data: torch.Tensor) -> bytes:
    """A frame for ``key`` sealed with another deployment's secret."""
    return encode(key, data, make_context(frame_secret=THEIRS).codec)


Plant = Callable[[Any, bytes], None]
Present = Callable[[Any], bool]


@pytest.fixture
def redis_tier(redis_server: RedisServer) -> Iterator[tuple[StorageBackend, Plant, Present]]:
    ctx = make_context(key_path="backends[1]", frame_secret=SECRET)
    b = create_redis_backend({"url": redis_server.url, "prefix": "verdict:", "delete_corrupt": True}, ctx)
    raw = redis_server.client()
    yield b, lambda key, frame: raw.set(b._name(key), frame), lambda key: raw.exists(b._name(key)) == 1
    b.close()


@pytest.fixture
def s3_tier(s3_server: MotoS3, s3_bucket: str) -> Iterator[tuple[StorageBackend, Plant, Present]]:
    b = create_s3_backend(s3_server.options(s3_bucket, delete_corrupt=True), make_context(frame_secret=SECRET))
    client = s3_server.client()

    def plant(key: Any, frame: bytes) -> None:
        client.put_object(Bucket=s3_bucket, Key=b.cfg.object_name(key.to_str()), Body=frame)

    def present(key: Any) -> bool:
        listed = client.list_objects_v2(Bucket=s3_bucket, Prefix=b.cfg.object_name(key.to_str()))
        return listed.get("KeyCount", 0) == 1

    yield b, plant, present
    b.close()


@pytest.mark.parametrize("which", ["redis_tier", "s3_tier"])
def test_another_deployments_frame_of_another_shape_is_kept_not_corrupt(which: str, request: pytest.FixtureRequest) -> None:
    tier, plant, present = request.getfixturevalue(which)
    key, data = random_key(), random_chunk(SHAPE)
    plant(key, theirs(key, data))
    assert tier.get(key, torch.empty(OTHER_SHAPE, dtype=torch.float16)) is False
    assert tier.stats().extra["corrupt"] == 0 and present(key)  # the caller could not take it: left alone
    # at the caller's shape the same frame is foreign: counted, and kept
    assert tier.get(key, torch.empty_like(data)) is False
    assert tier.stats().extra["corrupt"] == 1 and present(key)


class _Reversed:
    """A codec no tier here has installed: the bytes reversed."""

    name = "test-reversed"
    max_ratio = 1

    def encode(self, raw: memoryview) -> bytes:
        return bytes(raw)[::-1]

    def decode(self, payload: memoryview, raw_len: int) -> bytes:
        return bytes(payload)[::-1]


@pytest.mark.parametrize("which", ["redis_tier", "s3_tier"])
def test_delete_corrupt_deletes_damaged_frames_and_keeps_foreign_ones(which: str, request: pytest.FixtureRequest) -> None:
    """A well-formed frame this reader does not take (written with a codec it lacks, or
    sealed with another deployment's key) is a miss counted as corrupt and stays for the
    readers that take it; our own frame with one payload byte flipped is deleted (the
    control: ``delete_corrupt`` is on)."""
    tier, plant, present = request.getfixturevalue(which)
    ours = make_context(frame_secret=SECRET).codec
    foreign = {
        "codec not installed here": lambda key, data: encode(key, data, SealedCodec(_Reversed(), FrameSeal(SECRET))),
        "another deployment's seal": theirs,
    }
    for n, (why, frame_of) in enumerate(foreign.items()):
        key, data = random_key(), random_chunk(SHAPE)
        plant(key, frame_of(key, data))
        assert tier.get(key, torch.empty_like(data)) is False, why
        assert tier.stats().extra["corrupt"] == 2 * n + 1 and present(key), why
        damaged = bytearray(encode(key, data, ours))
        damaged[-1] ^= 0xFF
        plant(key, bytes(damaged))
        assert tier.get(key, torch.empty_like(data)) is False, why
        assert tier.stats().extra["corrupt"] == 2 * n + 2 and not present(key), why


def test_a_redis_value_longer_than_any_frame_for_the_chunk_is_judged_by_its_header(
    redis_tier: tuple[StorageBackend, Plant, Present],
) -> None:
    """Only a bounded prefix is read: a valid frame of a larger shape is a wrong-shape
    miss (kept); the same bytes grown past their header's length are corrupt (deleted)."""
    tier, plant, present = redis_tier
    key, big = random_key(), random_chunk((256, 1024))  # 512 KiB, far above the 4 KiB chunk's bound
    frame = encode(key, big, make_context(frame_secret=SECRET).codec)
    plant(key, frame)
    small = torch.empty(OTHER_SHAPE, dtype=torch.float16)
    assert tier.get(key, small) is False
    assert tier.stats().extra["corrupt"] == 0 and present(key)
    out = torch.empty_like(big)
    assert tier.get(key, out) and torch.equal(out, big)  # positive control: the value is intact
    plant(key, frame + b"\0" * 4096)
    assert tier.get(key, small) is False
    assert tier.stats().extra["corrupt"] == 1 and not present(key)


def test_disk_drops_another_deployments_file_whatever_its_shape(tmp_path: Path) -> None:
    """A file the tier keeps for another caller must verify as ours; one sealed with
    another key is dropped as before (a miss, never an exception), while our own file
    of another shape is kept (the control)."""
    b = create_disk_backend({"path": str(tmp_path / "t")}, make_context(key_path="backends[1]", frame_secret=SECRET))
    assert b.wait_for_scan(60)
    try:
        ours, theirs_key, data = random_key(), random_key(), random_chunk(SHAPE)
        assert b.put(ours, data) and b.put(theirs_key, data)
        b.directory.chunk_path(theirs_key).write_bytes(theirs(theirs_key, data))
        other_shape = torch.empty(OTHER_SHAPE, dtype=torch.float16)
        assert b.get(ours, other_shape) is False and b.directory.chunk_path(ours).exists()
        assert b.stats().extra["shape_mismatch"] == 1 and b.stats().extra["corrupt_removed"] == 0
        assert b.get(theirs_key, other_shape) is False
        assert not b.directory.chunk_path(theirs_key).exists() and b.stats().extra["corrupt_removed"] == 1
        assert b.stats().extra["shape_mismatch"] == 1
    finally:
        b.close()
