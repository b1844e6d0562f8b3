"""Build a :class:`MooncakeBackend` from its ``backends:`` section.

The engine's memory pool is registered with the store so puts transfer straight out
of it. With ``verify_on_start`` a master that cannot be reached fails startup with
one message naming the key path, the master and what to check; without it the tier
starts as down, its calls are misses, and it keeps connecting in the background.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmcache_core.backend import BackendContext, BackendError
from lmcache_core.config import validate_section
from lmcache_core.memory import MemoryPool

from .backend import MooncakeBackend, Region
from .client import import_store
from .config import MooncakeConfig


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
    import_store()  # a missing wheel or system library fails here, with what to install
    backend = MooncakeBackend(cfg, codec=ctx.codec, codecs=ctx.codecs, pool_region=pool_region(ctx.pool), region_owner=ctx.pool)
    if not cfg.verify_on_start:
        try:
            backend.connect()
        except BackendError:
            backend.connect_in_background()
        return backend
    try:
        backend.connect()
    except BackendError as err:
        backend.close()
        raise BackendError(
            f"{ctx.key_path} (from {ctx.source}): {err}; or set verify_on_start: false to start with the tier down"
        ) from None
    return backend
