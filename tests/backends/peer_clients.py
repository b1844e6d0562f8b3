"""What the peer node's tests share: the secrets they run under, a node started with
a secret file, frames to store, and an authenticated raw connection (to send bytes
the client library never would)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer_node import PeerNode  # noqa: E402

from lmcache_backend_peer import PeerClient  # noqa: E402
from lmcache_backend_peer.auth import client_handshake  # noqa: E402
from lmcache_backend_peer.connection import Connection  # noqa: E402
from lmcache_core.keys import ChunkKey  # noqa: E402
from lmcache_core.serde import RawCodec, encode  # noqa: E402
from lmcache_core.testing import random_chunk, random_key  # noqa: E402

SECRET = "peer-node-test-secret-0123456789abcdef"
VICTIM, VICTIM_SECRET = "t-victim", "victim-secret-9f8e7d6c5b4a3210"
MALLORY, MALLORY_SECRET = "t-mallory", "mallory-secret-0a1b2c3d4e5f6789"


def write_secret(directory: Path) -> Path:
    """``directory``/peer.secret holding ``SECRET``."""
    f = directory / "peer.secret"
    f.write_text(SECRET + "\n")
    return f


def start_node(directory: Path, options: list[str]) -> PeerNode:
    """A node with ``options`` and the shared secret ``SECRET`` (from a file in ``directory``)."""
    return PeerNode(options, write_secret(directory))


def port_of(node: PeerNode) -> tuple[str, int]:
    return ("127.0.0.1", node.port)


def frame_of(key: ChunkKey, seed: int) -> bytes:
    """A valid frame of a small random chunk under ``key``."""
    return bytes(encode(key, random_chunk(shape=(8, 64), seed=seed), RawCodec()))


def stored_keys(node: PeerNode, n: int = 4) -> list[ChunkKey]:
    """``n`` fresh keys, each stored on ``node`` with the shared secret."""
    client = PeerClient(port_of(node), SECRET.encode(), timeout=5.0)
    keys = [random_key() for _ in range(n)]
    for i, k in enumerate(keys):
        assert client.put(k, frame_of(k, i))
    client.close()
    return keys


def authenticated(address: tuple[str, int], name: str = "test") -> Connection:
    """A raw connection to ``address`` that has proved ``SECRET``."""
    conn = Connection(socket.create_connection(address, timeout=5), name)
    client_handshake(conn, SECRET.encode(), time.monotonic() + 5)
    return conn
