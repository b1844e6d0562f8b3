"""The ``s3`` section of ``backends:``: every option, its default and its bounds.

Validated with :func:`lmcache_core.config.validate_section`, so a wrong value fails at
startup with its key path and source instead of degrading silently. There is
deliberately no key for credentials: they come from boto3's standard chain only.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from lmcache_core.config import DAY, HOUR, ByteSize, Flag, StrictModel, seconds

MIN_PART_SIZE = 5 * 2**20  # S3's smallest multipart part (all parts but the last)
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]$")


class S3Config(StrictModel):
    bucket: str = Field(description="bucket that holds the chunks; must exist")
    prefix: str = Field("lmcache", description="object names are {prefix}/{chunk key}; '' for the bucket root")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, Ceph RGW, ...); None for AWS")
    region: str | None = Field(None, description="signing region; None: boto3's chain, else us-east-1")
    profile: str | None = Field(None, description="named profile from the shared AWS config files")
    addressing_style: Literal["auto", "path", "virtual"] = Field("auto", description="bucket in the path or the host")
    max_concurrency: int = Field(16, ge=1, le=256, description="parallel requests (and pooled connections)")
    connect_timeout_s: Annotated[float, seconds(300)] = Field(2.0, description="TCP connect timeout per attempt")
    read_timeout_s: Annotated[float, seconds(HOUR)] = Field(10.0, description="socket read timeout per attempt")
    max_attempts: int = Field(3, ge=1, le=20, description="attempts per request, the first included")
    retry_mode: Literal["standard", "adaptive", "legacy"] = Field("standard", description="botocore retry mode")
    op_deadline_s: Annotated[float, seconds(HOUR)] = Field(
        10.0,
        description="total deadline for one lookup, get, put or remove, retries included; past it: a miss and the endpoint counts as down",
    )
    multipart_threshold: ByteSize = Field(64 * 2**20, description="frames this large or larger use multipart upload")
    multipart_chunksize: ByteSize = Field(16 * 2**20, description="part size for multipart uploads (>= 5MiB)")
    range_chunksize: ByteSize = Field(16 * 2**20, description="bytes per GET; larger objects are fetched as parallel ranged GETs")
    check_exists_before_put: Flag = Field(
        True, description="HEAD before PUT so chunks another instance already stored are not uploaded again"
    )
    presence_cache_size: int = Field(65536, ge=0, description="keys remembered as present (0 disables)")
    presence_ttl_s: Annotated[float, seconds(DAY, off=True)] = Field(
        300.0, description="how long a remembered key is trusted without a request"
    )
    down_cooldown_s: Annotated[float, seconds(HOUR, off=True)] = Field(
        5.0, description="after the endpoint fails, calls are misses without a request for this long"
    )
    verify_on_start: Flag = Field(True, description="check the bucket and credentials when the tier is created")
    delete_corrupt: Flag = Field(
        False,
        description="delete objects found damaged when read (checksum or MAC mismatch, truncated, malformed); frames another reader may take are kept",
    )
    tenant_quota: ByteSize | None = Field(
        None,
        description="hard byte quota of this engine's tenant (the top-level tenant label) under this prefix, which "
        "must be the tenant's own: a put past it deletes the tenant's own oldest chunks first, one larger than it is "
        "refused; null: no quota",
    )

    @field_validator("bucket")
    @classmethod
    def _bucket_name(cls, v: str) -> str:
        if not _BUCKET_RE.match(v) or ".." in v:
            raise ValueError(f"{v!r} is not a valid bucket name (3-255 chars: lowercase letters, digits, '.', '-', '_')")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        v = v.strip("/")
        if any(part in ("", ".", "..") for part in v.split("/")) and v:
            raise ValueError(f"prefix {v!r} must not contain empty, '.' or '..' segments")
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"endpoint_url must look like http://host:port or https://host, got {v!r}")
        return v

    @model_validator(mode="after")
    def _sizes(self) -> "S3Config":
        if self.multipart_chunksize < MIN_PART_SIZE:
            raise ValueError(
                f"multipart_chunksize must be at least 5MiB (S3's minimum part size), got {self.multipart_chunksize}"
            )
        if self.multipart_threshold < self.multipart_chunksize:
            raise ValueError("multipart_threshold must be at least multipart_chunksize")
        if self.range_chunksize < 64 * 2**10:
            raise ValueError(f"range_chunksize must be at least 64KiB, got {self.range_chunksize}")
        if self.tenant_quota is not None and self.tenant_quota <= 0:
            raise ValueError("tenant_quota must be a positive size (or null for no quota)")
        return self

    def object_name(self, key_str: str) -> str:
        return f"{self.prefix}/{key_str}" if self.prefix else key_str
