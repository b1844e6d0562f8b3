"""Entry point ``disk`` in the group ``lmcache_core.backends``. It only registers:
the factory is a dotted path, imported when a config selects the tier."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "disk",
        "lmcache_backend_disk.backend:create_disk_backend",
        description="local disk tier (durable, shared by local processes, LRU)",
    )
