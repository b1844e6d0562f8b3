"""Entry point ``mooncake`` in the group ``lmcache_core.backends``.

The Mooncake client (a large native extension) is imported only when a ``mooncake``
tier is created, never when plugins are loaded.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmcache_core.backend import BackendContext, StorageBackend
from lmcache_core.hookspecs import RegisterBackend, hookimpl


def create_mooncake_backend(section: Mapping[str, Any], ctx: BackendContext) -> StorageBackend:
    """Factory for ``{name: mooncake, master: host:port, metadata: ..., ...}``."""
    from .factory import create_mooncake_backend as create

    return create(section, ctx)


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register("mooncake", create_mooncake_backend, description="Mooncake Store: a DRAM pool shared across nodes")
