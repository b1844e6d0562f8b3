"""The ``redis`` tier's factory (registered by dotted path in :mod:`.plugin`).

It validates the section, builds the tier and (``verify_on_start``) PINGs the
server, or every cluster node, once, so a wrong password, an unknown ACL user or a TLS
mismatch fails at startup with one message that names the target and what to do. A
server that does not answer at startup is not fatal: the tier starts as down and its
calls are misses until it answers (storage is a cache).
"""

from __future__ import annotations

from typing import Any, Mapping

from lmcache_core.backend import BackendContext, BackendError, checked_at_start
from lmcache_core.config import ConfigError, validate_section

from .backend import RedisBackend
from .client import Failure, classify, describe
from .config import RedisConfig, check_tls_files, load_password


def _verify(backend: RedisBackend, ctx: BackendContext) -> None:
    where = f"{backend.target} ({ctx.key_path}, from {ctx.source})"
    try:
        backend.ping()
        backend.quota_usage()  # the tenant's usage in stats() from the start (None without a quota)
    except Exception as err:
        kind = classify(err)
        if kind is Failure.DENIED:
            raise BackendError(
                f"redis tier: {where} refused the credentials: {describe(err)}. Set {ctx.key_path}.password_file "
                f"(or password, or user:password in the url) and {ctx.key_path}.username for an ACL user, to what "
                "the server's requirepass / ACL SETUSER says"
            ) from None
        if kind is Failure.UNAVAILABLE:
            if "SSL" in str(err) or "certificate" in str(err).lower():
                raise BackendError(
                    f"redis tier: TLS handshake with {where} failed: {describe(err)}. Check the scheme (rediss:// only "
                    f"if the server has tls-port), {ctx.key_path}.tls_ca_file and the certificate's host name"
                ) from None
            backend.mark_unavailable("startup check", err)
            return
        raise BackendError(f"redis tier: cannot use {where}: {describe(err)}") from None
    backend.mark_available()


def create_redis_backend(section: Mapping[str, Any], ctx: BackendContext) -> RedisBackend:
    """Factory for ``{name: redis, url: ...}`` or ``{name: redis, cluster: [...]}`` (see :class:`RedisConfig`)."""
    cfg = validate_section(RedisConfig, section, ctx.key_path, ctx.source)
    password = load_password(cfg, ctx.key_path, ctx.source)
    check_tls_files(cfg, ctx.key_path, ctx.source)
    if cfg.tenant_quota is not None and ctx.config.tenant is None:
        raise ConfigError(
            f"{ctx.key_path}.tenant_quota: a quota is per tenant, and this engine has no tenant label: set the "
            "top-level tenant: LABEL (the same label on every engine of that tenant) or remove tenant_quota "
            f"(from {ctx.source})"
        )
    backend = RedisBackend(cfg, codec=ctx.codec, codecs=ctx.codecs, password=password, tenant=ctx.config.tenant)
    if cfg.verify_on_start:
        checked_at_start(backend, lambda: _verify(backend, ctx))
    return backend
