"""The S3 tier for lmcache-core: any S3 or S3-compatible object store, via boto3.

The shared, durable tier for many serving instances. Chunks are stored as serde
frames under ``{prefix}/{key}``; credentials come only from boto3's standard chain.
Configured as ``{name: s3, bucket: ..., ...}`` (see :class:`S3Config`).
"""

from typing import TYPE_CHECKING

from lmcache_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import S3Backend
    from .config import S3Config
    from .factory import create_s3_backend

__all__ = [
    "S3Backend",
    "S3Config",
    "create_s3_backend",
]

# Public names import their modules on first use: the entry point imports this
# package whenever plugins load, and must not pull in the tier's dependencies.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "S3Backend": ".backend",
        "S3Config": ".config",
        "create_s3_backend": ".factory",
    },
)
