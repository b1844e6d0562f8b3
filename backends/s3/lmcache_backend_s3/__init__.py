"""The S3 tier for lmcache-core: any S3 or S3-compatible object store, via boto3.

The shared, durable tier for many serving instances. Chunks are stored as serde
frames under ``{prefix}/{key}``; credentials come only from boto3's standard chain.
Configured as ``{name: s3, bucket: ..., ...}`` (see :class:`S3Config`).
"""

from .backend import S3Backend
from .config import S3Config
from .plugin import create_s3_backend

__all__ = ["S3Backend", "S3Config", "create_s3_backend"]
