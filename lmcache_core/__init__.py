"""lmcache-core: a KV-cache layer for LLM serving.

Public API: :class:`CacheEngine` (tier orchestration), :func:`load_config`,
:class:`KeyNamespace`/:class:`ChunkKey` (chunk keys), :class:`StorageBackend`
(the backend contract) and :mod:`lmcache_core.hookspecs` (plugin hooks).
"""

from .backend import BackendContext, BackendError, BackendStats, StorageBackend
from .config import ConfigError, CoreConfig, load_config
from .engine import CacheEngine
from .keys import ChunkKey, KeyNamespace, chunk_hashes
from .memory import MemoryBuffer, MemoryPool

__version__ = "0.1.0"

__all__ = [
    "BackendContext",
    "BackendError",
    "BackendStats",
    "CacheEngine",
    "ChunkKey",
    "ConfigError",
    "CoreConfig",
    "KeyNamespace",
    "MemoryBuffer",
    "MemoryPool",
    "StorageBackend",
    "chunk_hashes",
    "load_config",
]
