"""The ``disk`` tier for lmcache-core: one serde frame per chunk file under a
directory that survives restarts and is shared by the processes of one machine."""

from .backend import DiskBackend, create_disk_backend
from .config import DiskConfig

__all__ = ["DiskBackend", "DiskConfig", "create_disk_backend"]
