"""Building the boto3 client, and sorting botocore errors into what they mean for a cache.

One client per tier: boto3 clients are thread-safe and pool their connections
(``max_pool_connections`` = ``max_concurrency``). Timeouts and retries are botocore's
own (``connect_timeout``, ``read_timeout``, ``total_max_attempts`` with exponential
backoff), so every request is bounded. Credentials come from boto3's chain only.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from .config import S3Config

DEFAULT_REGION = "us-east-1"


def _session(cfg: S3Config) -> boto3.session.Session:
    return boto3.session.Session(profile_name=cfg.profile) if cfg.profile else boto3.session.Session()


def credential_method(cfg: S3Config) -> str | None:
    """Where boto3's chain found credentials ("env", "shared-credentials-file",
    "iam-role", ...), for error messages; never the credentials themselves."""
    try:
        creds = _session(cfg).get_credentials()
    except Exception:
        return None
    return getattr(creds, "method", None) if creds is not None else None


def make_client(cfg: S3Config) -> Any:
    """A boto3 S3 client configured from ``cfg`` (timeouts, retries, pool size)."""
    session = _session(cfg)
    region = cfg.region or session.region_name or DEFAULT_REGION
    bc = Config(
        region_name=region,
        connect_timeout=cfg.connect_timeout_s,
        read_timeout=cfg.read_timeout_s,
        retries={"total_max_attempts": cfg.max_attempts, "mode": cfg.retry_mode},
        max_pool_connections=cfg.max_concurrency,
        s3={"addressing_style": cfg.addressing_style},
        signature_version="s3v4",
    )
    return session.client("s3", endpoint_url=cfg.endpoint_url, config=bc)


class Failure(Enum):
    """What a failed request means for the tier."""

    MISSING = "missing"  # 404: an ordinary miss
    UNAVAILABLE = "unavailable"  # endpoint down, timed out, 5xx/throttled after retries
    DENIED = "denied"  # credentials or permissions
    OTHER = "other"  # anything else: a miss, counted as an error


def status_of(err: ClientError) -> int:
    return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def classify(err: BaseException) -> Failure:
    if isinstance(err, ClientError):
        status = status_of(err)
        code = str(err.response.get("Error", {}).get("Code", ""))
        if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
            return Failure.MISSING
        if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return Failure.DENIED
        if status >= 500 or status == 429 or code in ("SlowDown", "Throttling", "RequestTimeout"):
            return Failure.UNAVAILABLE
        return Failure.OTHER
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return Failure.DENIED
    if isinstance(err, (BotoConnectionError, HTTPClientError, TimeoutError, ConnectionError)):
        return Failure.UNAVAILABLE
    if isinstance(err, BotoCoreError):
        return Failure.OTHER
    return Failure.OTHER


def describe(err: BaseException) -> str:
    """A one-line description without request headers (which carry the access key id)."""
    if isinstance(err, ClientError):
        e = err.response.get("Error", {})
        return f"HTTP {status_of(err)} {e.get('Code', '')}: {e.get('Message', '')}".strip()
    return f"{type(err).__name__}: {err}"
