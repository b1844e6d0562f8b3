"""Build a :class:`MooncakeBackend` from its ``backends:`` section.

The engine's memory pool is registered with the store so puts transfer straight out
of it. With ``verify_on_start`` a master that cannot be reached fails startup with
one message naming the key path, the master and what to check; without it the tier
starts as down, its calls are misses, and it keeps connecting in the background.

With ``tenant_quota`` the engine needs a ``tenant`` label (else a config error), and
``verify_on_start`` also reads the master's metrics server: a master that keeps no
tenant quotas (started without ``--enable_multi_tenants``), or none for this tenant,
fails startup, since its puts would then be unbounded or all refused.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from lmcache_core.backend import BackendContext, BackendError
from lmcache_core.config import ConfigError, validate_section
from lmcache_core.memory import MemoryPool

from .backend import MooncakeBackend, Region
from .client import import_store
from .config import MooncakeConfig
from .quota import QuotaUnknown

log = logging.getLogger(__name__)


def pool_region(pool: MemoryPool) -> Region | None:
    """``(base, bytes)`` of the pool's one backing allocation (every buffer is a view of it)."""
    probe = pool.allocate((1,), torch.uint8)
    if probe is None:
        return None
    try:
        storage = probe.tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    finally:
        probe.release()


def create_mooncake_backend(section: Mapping[str, Any], ctx: BackendContext) -> MooncakeBackend:
    """Factory for ``{name: mooncake, master: ..., metadata: ..., ...}`` (see :class:`MooncakeConfig`)."""
    cfg = validate_section(MooncakeConfig, section, ctx.key_path, ctx.source)
    if cfg.tenant_quota and ctx.config.tenant is None:
        raise ConfigError(
            f"{ctx.key_path}.tenant_quota: the quota is the master's quota for this engine's tenant, and this engine "
            "has no tenant label: set the top-level tenant: LABEL (the same label on every engine of that tenant, "
            f"and a quota for it in the master's tenant quota policy) or remove tenant_quota (from {ctx.source})"
        )
    import_store()  # a missing wheel or system library fails here, with what to install
    backend = MooncakeBackend(
        cfg,
        codec=ctx.codec,
        codecs=ctx.codecs,
        pool_region=pool_region(ctx.pool),
        region_owner=ctx.pool,
        tenant=ctx.config.tenant,
    )
    if not cfg.verify_on_start:
        try:
            backend.connect()
        except BackendError:
            backend.connect_in_background()
        return backend  # the tenant's quota is not checked (puts the master refuses for it are counted)
    try:
        backend.connect()
    except BackendError as err:
        backend.close()
        raise BackendError(
            f"{ctx.key_path} (from {ctx.source}): {err}; or set verify_on_start: false to start with the tier down"
        ) from None
    try:
        quota = backend.quota_usage(min(cfg.setup_timeout_s, 5.0))
    except QuotaUnknown as err:
        backend.close()
        hint = (
            f". Set {ctx.key_path}.master_metrics to the master's metrics server (http://host:port, its --metrics_port) "
            "if it is not on the master's host at port 9003, or verify_on_start: false to start without this check"
            if err.unreachable
            else ""
        )
        raise BackendError(f"{ctx.key_path}.tenant_quota (from {ctx.source}): tenant {backend.tenant!r}: {err}{hint}") from None
    if quota is not None and quota.effective < quota.requested:
        log.warning(
            "mooncake tier %s: master %s enforces %d bytes for tenant %r, not the policy's %d: the policy's quotas add up "
            "to more than the pool holds, and the master scales them all down",
            ctx.key_path,
            cfg.master,
            quota.effective,
            quota.tenant,
            quota.requested,
        )
    return backend
