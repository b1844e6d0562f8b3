"""The ``s3`` tier's factory (registered by dotted path in :mod:`.plugin`).

It validates the section, builds the tier, and (``verify_on_start``) asks the
bucket once, so a missing bucket or wrong credentials fail at startup with one message
that names the bucket, the endpoint and what to do. An endpoint that does not answer
at startup is not fatal: the tier starts as down and its calls are misses until it
answers (storage is a cache).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from botocore.exceptions import NoCredentialsError, PartialCredentialsError, ProfileNotFound

from lmcache_core.backend import BackendContext, BackendError, checked_at_start
from lmcache_core.config import ConfigError, validate_section

from .backend import S3Backend
from .client import Failure, classify, credential_method, describe
from .config import S3Config


def _credential_source(cfg: S3Config) -> str:
    method = credential_method(cfg)
    return f"credentials boto3 found ({method})" if method else "credentials in boto3's default chain"


def _verify(backend: S3Backend, ctx: BackendContext) -> None:
    where = f"bucket {backend.bucket!r} at {backend.endpoint} ({ctx.key_path}, from {ctx.source})"
    try:
        backend.check_bucket()
        if backend.quota is not None:  # the tenant's usage in stats() from the start; a foreign ledger fails here
            backend.quota.usage(backend.op_deadline_s + time.monotonic())
    except BackendError as err:  # the quota's ledger under the prefix is another tenant's, or not one
        raise ConfigError(f"{ctx.key_path}.prefix: {err} (from {ctx.source})") from None
    except (NoCredentialsError, PartialCredentialsError) as err:
        raise BackendError(
            f"s3 tier: no usable AWS credentials for {where}: {err}. Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run with an instance role"
        ) from None
    except Exception as err:
        kind = classify(err)
        if kind is Failure.MISSING:
            raise ConfigError(
                f"{ctx.key_path}.bucket: {where} does not exist. Create it (e.g. `aws s3 mb "
                f"s3://{backend.bucket} --endpoint-url {backend.endpoint}`) or fix the name"
            ) from None
        if kind is Failure.DENIED:
            raise BackendError(
                f"s3 tier: access denied to {where}: {describe(err)}. Check the {_credential_source(backend.cfg)}: "
                "the key must be valid for this endpoint and allow s3:ListBucket, s3:GetObject, s3:PutObject"
            ) from None
        if kind is Failure.UNAVAILABLE:
            backend.mark_unavailable("startup check", err)
            return
        raise BackendError(f"s3 tier: cannot use {where}: {describe(err)}") from None


def create_s3_backend(section: Mapping[str, Any], ctx: BackendContext) -> S3Backend:
    """Factory for ``{name: s3, bucket: ..., ...}`` (see :class:`S3Config`)."""
    cfg = validate_section(S3Config, section, ctx.key_path, ctx.source)
    if cfg.tenant_quota is not None and ctx.config.tenant is None:
        raise ConfigError(
            f"{ctx.key_path}.tenant_quota: a quota is per tenant, and this engine has no tenant label: set the "
            "top-level tenant: LABEL (the same label, prefix and quota on every engine of that tenant) or remove "
            f"tenant_quota (from {ctx.source})"
        )
    try:
        backend = S3Backend(cfg, codec=ctx.codec, codecs=ctx.codecs, tenant=ctx.config.tenant)
    except ProfileNotFound as err:
        raise ConfigError(f"{ctx.key_path}.profile: {err} (from {ctx.source}); check ~/.aws/config or AWS_CONFIG_FILE") from None
    if cfg.verify_on_start:
        checked_at_start(backend, lambda: _verify(backend, ctx))
    return backend
