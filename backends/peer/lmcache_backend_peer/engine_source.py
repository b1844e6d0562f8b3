"""Serve an engine's CPU tier directly: ``serve_engine(engine, listen, secret)``.

The peer *backend* serves what is put into it (its own store). An application that
holds the :class:`~lmcache_core.CacheEngine` can instead serve the chunks already in
the memory pool's CPU tier, encoding each frame on request: no second copy in memory.
"""

from __future__ import annotations

from typing import Any, Sequence

from lmcache_core.backend import ZERO_COPY
from lmcache_core.keys import ChunkKey
from lmcache_core.frames import FrameWriter

from .server import Address, PeerServer


class EngineSource:
    """A read-only :class:`~lmcache_backend_peer.store.ChunkSource` over an engine's
    first tier, which must be the zero-copy CPU tier."""

    def __init__(self, engine: Any) -> None:
        if not engine.tiers or ZERO_COPY not in engine.tiers[0].capabilities:
            raise ValueError("serve_engine needs an engine whose first tier is the CPU tier (local_cpu)")
        self.tier = engine.tiers[0]
        self.codec = engine.codec

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        return int(self.tier.contains(keys))

    def get_frame(self, key: ChunkKey) -> bytes | None:
        buf = self.tier.get_buffer(key)
        if buf is None:
            return None
        try:
            return FrameWriter.encode(key, buf.tensor, self.codec)
        finally:
            buf.release()


def serve_engine(engine: Any, listen: Address, secret: bytes, **server_options: Any) -> PeerServer:
    """Start a read-only server for ``engine``'s CPU tier; close it before the engine."""
    return PeerServer(EngineSource(engine), listen, secret, **server_options)
