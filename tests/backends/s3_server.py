"""A real S3 endpoint on loopback for the s3 tier's tests: moto's ThreadedMotoServer.

Fixtures: ``s3_server`` (one server per session, dummy credentials in the
environment, no AWS config files, no instance-metadata lookups) and ``s3_bucket``
(a fresh bucket per test). ``MotoS3`` starts extra servers for tests that stop one.
Conditional PUTs are made atomic on the server, as on S3 (:func:`_atomic_conditional_puts`).
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Iterator

import boto3
import pytest
from botocore.config import Config
from moto.s3.responses import S3Response
from moto.server import ThreadedMotoServer

ACCESS_KEY = "AKIATESTLMCACHE00001"
SECRET_KEY = "s3cr3t-lmcache-test-Zq9wXv7Ru5Ts3Pn1"

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
AWS_ENV_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION")


_CONDITIONAL = threading.Lock()


def _atomic_conditional_puts() -> None:
    """Make moto's conditional PutObject atomic, as S3's is: moto checks ``If-Match`` /
    ``If-None-Match`` and then stores the object in two steps, so two concurrent
    conditional PUTs of one name could both pass. One lock around the PUTs that carry a
    condition closes that window (the tier's quota ledger relies on it)."""
    if getattr(S3Response.put_object, "lmcache_atomic", False):
        return
    plain = S3Response.put_object

    def put_object(self: S3Response) -> Any:
        if self.headers.get("If-Match") or self.headers.get("If-None-Match"):
            with _CONDITIONAL:
                return plain(self)
        return plain(self)

    put_object.lmcache_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


class MotoS3:
    """One moto server on 127.0.0.1 at a free port."""

    def __init__(self) -> None:
        _atomic_conditional_puts()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port: int = self.server._server.server_port  # port 0: the OS picked one
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.running = True

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 2}),
        )

    def make_bucket(self) -> str:
        name = f"lmc-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def options(self, bucket: str, **options: Any) -> dict[str, Any]:
        """The s3 factory's section for this server (what a ``backends:`` entry holds besides ``name``)."""
        return {"bucket": bucket, "endpoint_url": self.endpoint, "addressing_style": "path", **options}

    def section(self, bucket: str, **options: Any) -> dict[str, Any]:
        """A whole ``backends:`` entry for this server."""
        return {"name": "s3", **self.options(bucket, **options)}

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.server.stop()


def set_aws_env(mp: pytest.MonkeyPatch) -> None:
    for k, v in AWS_ENV.items():
        mp.setenv(k, v)
    for k in AWS_ENV_UNSET:
        mp.delenv(k, raising=False)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    with pytest.MonkeyPatch.context() as mp:
        set_aws_env(mp)
        server = MotoS3()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> str:
    set_aws_env(monkeypatch)
    return s3_server.make_bucket()
