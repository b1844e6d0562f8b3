"""Where things live in the tier's directory, and what a name found there means.

::

    <path>/LMCACHE_DISK_TIER        marker: this directory belongs to a disk tier
    <path>/<hh>/<key.to_str()>      one chunk frame; <hh> = first two hex chars of the chunk hash
    <path>/<hh>/.tmp-<pid>-<rand>   a write in progress (renamed onto the chunk name when complete)

The marker keeps the tier from ever deleting files in a directory it does not own:
a non-empty directory without it is refused.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from lmcache_core.keys import ChunkKey

MARKER = "LMCACHE_DISK_TIER"
MARKER_TEXT = "lmcache-core disk tier, layout 1\n"
TMP_PREFIX = ".tmp-"
FANOUT = [f"{i:02x}" for i in range(256)]


@dataclass(frozen=True)
class Layout:
    root: Path

    def shard(self, key: ChunkKey) -> Path:
        return self.root / key.chunk_hash[:1].hex()

    def chunk_path(self, key: ChunkKey) -> Path:
        return self.shard(key) / key.to_str()

    def temp_path(self, key: ChunkKey) -> Path:
        return self.shard(key) / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"

    @property
    def marker(self) -> Path:
        return self.root / MARKER


def parse_chunk_name(shard: str, name: str) -> ChunkKey | None:
    """The key a file name stands for, or None when the name is not a chunk of
    this shard (a foreign file, or a chunk filed under the wrong shard)."""
    try:
        key = ChunkKey.parse(name)
    except ValueError:
        return None
    return key if key.chunk_hash[:1].hex() == shard else None


def temp_owner_pid(name: str) -> int | None:
    """The pid that created a temp file (from its name), or None if malformed."""
    if not name.startswith(TMP_PREFIX):
        return None
    pid, _, _ = name[len(TMP_PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True
