"""The Redis / Valkey tier for lmcache-core: a single server or a Redis Cluster, via redis-py.

For teams that already run Redis or Valkey and would rather share KV through it than
operate a new service. Chunks are stored as serde frames (checksummed) under
``{prefix}{chunk key}``; memory limits and eviction are the server's. Configured as
``{name: redis, url: redis://host:6379/0}`` or ``{name: redis, cluster: [host:port, ...]}``
(see :class:`RedisConfig` and docs/backends/redis.md).
"""

from typing import TYPE_CHECKING

from lmcache_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import RedisBackend
    from .config import RedisConfig
    from .factory import create_redis_backend

__all__ = [
    "RedisBackend",
    "RedisConfig",
    "create_redis_backend",
]

# Public names import their modules on first use: the entry point imports this
# package whenever plugins load, and must not pull in the tier's dependencies.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "RedisBackend": ".backend",
        "RedisConfig": ".config",
        "create_redis_backend": ".factory",
    },
)
