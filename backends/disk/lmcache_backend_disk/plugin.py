"""Entry point module (group ``lmcache_core.backends``, name ``disk``)."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    from .backend import create_disk_backend

    register("disk", create_disk_backend, description="local disk tier (durable, shared by local processes, LRU)")
