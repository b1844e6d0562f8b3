"""The s3 tier runs the backend conformance suite against a real S3 endpoint (moto on
loopback), with raw and lz4 frames; ``persistent``: a second instance sees the data."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import MotoS3, s3_bucket, s3_server  # noqa: E402,F401 - fixtures

from lmcache_backend_s3 import create_s3_backend  # noqa: E402
from lmcache_core.backend import BackendContext, StorageBackend  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402
from lmcache_core.testing import BackendConformance, Corrupt, Plant, ReplaceWith, flip_byte  # noqa: E402


class TestS3Conformance(BackendConformance):
    persistent = True

    @pytest.fixture(autouse=True)
    def _endpoint(self, s3_server: MotoS3, s3_bucket: str) -> None:
        self.server, self.bucket = s3_server, s3_bucket

    def _section(self, tmp_path: Path) -> dict[str, Any]:
        return self.server.options(self.bucket, prefix=f"conformance/{tmp_path.name}", max_concurrency=8)

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        return create_s3_backend(self._section(tmp_path), ctx)

    # The storage fixtures rewrite the objects through the tier's own S3 client.
    @pytest.fixture
    def corrupt(self, backend: Any) -> Corrupt:
        def corrupt(key: ChunkKey) -> None:
            name = backend._object(key)
            body = backend.client.get_object(Bucket=backend.bucket, Key=name)["Body"].read()
            backend.client.put_object(Bucket=backend.bucket, Key=name, Body=flip_byte(body))

        return corrupt

    @pytest.fixture
    def replace_with(self, backend: Any) -> ReplaceWith:
        def replace_with(key: ChunkKey, other: ChunkKey) -> None:
            body = backend.client.get_object(Bucket=backend.bucket, Key=backend._object(other))["Body"].read()
            backend.client.put_object(Bucket=backend.bucket, Key=backend._object(key), Body=body)

        return replace_with

    @pytest.fixture
    def plant(self, backend: Any) -> Plant:
        def plant(key: ChunkKey, frame: bytes) -> None:
            backend.client.put_object(Bucket=backend.bucket, Key=backend._object(key), Body=frame)

        return plant


class TestS3ConformanceLz4(TestS3Conformance):
    codec = "lz4"
