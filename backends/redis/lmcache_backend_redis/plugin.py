"""Entry point ``redis`` in the group ``lmcache_core.backends``. It only registers:
the factory is a dotted path, imported when a config selects the tier (redis-py
is imported then, never when plugins load)."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "redis",
        "lmcache_backend_redis.factory:create_redis_backend",
        description="Redis or Valkey, single server or cluster (shared)",
    )
