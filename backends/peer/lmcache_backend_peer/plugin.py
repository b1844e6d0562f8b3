"""Entry point ``peer`` in the group ``lmcache_core.backends``."""

from __future__ import annotations

from typing import Any, Mapping

from lmcache_core.backend import BackendContext, StorageBackend
from lmcache_core.hookspecs import RegisterBackend, hookimpl


def create_peer_backend(section: Mapping[str, Any], ctx: BackendContext) -> StorageBackend:
    from .factory import create_peer_backend as create

    return create(section, ctx)


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register("peer", create_peer_backend, description="share chunks between instances over authenticated TCP")
