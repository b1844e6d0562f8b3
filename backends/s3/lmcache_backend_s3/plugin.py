"""Entry point ``s3`` in the group ``lmcache_core.backends``. It only registers:
the factory is a dotted path, imported when a config selects the tier (boto3 is
imported then, never when plugins load)."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "s3", "lmcache_backend_s3.factory:create_s3_backend", description="S3 or S3-compatible object store (shared, durable)"
    )
