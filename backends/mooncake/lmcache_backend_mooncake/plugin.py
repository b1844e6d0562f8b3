"""Entry point ``mooncake`` in the group ``lmcache_core.backends``. It only registers:
the factory is a dotted path, imported when a config selects the tier (the
Mooncake client, a large native extension, is imported then, never when plugins load)."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "mooncake",
        "lmcache_backend_mooncake.factory:create_mooncake_backend",
        description="Mooncake Store: a DRAM pool shared across nodes",
    )
