"""lmcache-backend-peer: instances pull KV chunks from each other's memory.

- :class:`PeerBackend` (tier ``peer``): keeps and serves what is put into it, asks
  peers on a miss; created by :func:`create_peer_backend` from its config section.
- :class:`PeerServer`: serves any chunk source; :func:`serve_engine` serves an
  engine's CPU tier; ``lmcache-peer-serve`` runs a standalone cache node.
- :class:`PeerClient`: one remote peer, pooled authenticated connections.
- :mod:`.protocol`: the wire format (:class:`ProtocolError` for bad bytes).
"""

from typing import TYPE_CHECKING

from lmcache_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import PeerBackend
    from .client import PeerClient, PeerRequestError
    from .config import PeerConfig, parse_address
    from .engine_source import EngineSource, serve_engine
    from .factory import create_peer_backend
    from .protocol import PeerError, ProtocolError
    from .server import PeerServer
    from .store import FrameStore

__all__ = [
    "EngineSource",
    "FrameStore",
    "PeerBackend",
    "PeerClient",
    "PeerConfig",
    "PeerError",
    "PeerRequestError",
    "PeerServer",
    "ProtocolError",
    "create_peer_backend",
    "parse_address",
    "serve_engine",
]

# Public names import their modules on first use: the entry point imports this
# package whenever plugins load, and must not pull in the tier's dependencies.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "PeerBackend": ".backend",
        "PeerClient": ".client",
        "PeerRequestError": ".client",
        "PeerConfig": ".config",
        "parse_address": ".config",
        "EngineSource": ".engine_source",
        "serve_engine": ".engine_source",
        "create_peer_backend": ".factory",
        "PeerError": ".protocol",
        "ProtocolError": ".protocol",
        "PeerServer": ".server",
        "FrameStore": ".store",
    },
)
