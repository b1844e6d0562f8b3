"""The ``disk`` tier for lmcache-core: one serde frame per chunk file under a
directory that survives restarts and is shared by the processes of one machine."""

from typing import TYPE_CHECKING

from lmcache_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import DiskBackend, create_disk_backend
    from .config import DiskConfig

__all__ = [
    "DiskBackend",
    "DiskConfig",
    "create_disk_backend",
]

# Public names import their modules on first use: the entry point imports this
# package whenever plugins load, and must not pull in the tier's dependencies.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DiskBackend": ".backend",
        "create_disk_backend": ".backend",
        "DiskConfig": ".config",
    },
)
