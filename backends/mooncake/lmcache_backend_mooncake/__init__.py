"""The Mooncake Store tier for lmcache-core.

A fleet's shared DRAM pool: a ``mooncake_master`` keeps the metadata, segment owners
(this tier itself with ``segment_size`` > 0, or standalone ``mooncake_client``
services) hold the bytes. Chunks are serde frames under ``{key_prefix}{chunk key}``.
Configured as ``{name: mooncake, master: host:port, metadata: http://...}`` (see
:class:`MooncakeConfig`, docs/backends/mooncake.md). Importing this package does not
import the Mooncake client; the factory does.
"""

from typing import TYPE_CHECKING

from lmcache_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .config import MooncakeConfig
    from .factory import create_mooncake_backend

__all__ = [
    "MooncakeConfig",
    "create_mooncake_backend",
]

# Public names import their modules on first use: the entry point imports this
# package whenever plugins load, and must not pull in the tier's dependencies.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "MooncakeConfig": ".config",
        "create_mooncake_backend": ".factory",
    },
)
