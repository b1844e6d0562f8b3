"""Where things live in the tier's directory, and what a name found there means.

::

    <path>/LMCACHE_DISK_TIER        marker: this directory belongs to a disk tier
    <path>/LMCACHE_DISK_TIER.usage  the directory's byte count, shared by its processes (see budget.py)
    <path>/<hh>/<key.to_str()>      one chunk frame; <hh> = first two hex chars of the chunk hash
    <path>/<hh>/.tmp-<pid>-<rand>-<bytes>
                                    a write in progress of a <bytes>-byte frame (renamed onto the
                                    chunk name when complete)

The marker keeps the tier from ever deleting files in a directory it does not own:
a non-empty directory without it is refused. Inside the directory the tier never
follows a symbolic link: shard directories are opened with ``O_NOFOLLOW`` and every
file operation is relative to that descriptor (:meth:`TierDirectory.open_shard`), and the
only files it deletes are ones whose names it gives (chunk and temp names).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from lmcache_core.keys import ChunkKey

MARKER = "LMCACHE_DISK_TIER"
USAGE = "LMCACHE_DISK_TIER.usage"
MARKER_TEXT = "lmcache-core disk tier, layout 1\n"
TMP_PREFIX = ".tmp-"
FANOUT = [f"{i:02x}" for i in range(256)]
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class TierDirectory:
    root: Path

    def shard(self, key: ChunkKey) -> Path:
        return self.root / key.chunk_hash[:1].hex()

    def chunk_path(self, key: ChunkKey) -> Path:
        return self.shard(key) / key.to_str()

    @property
    def marker(self) -> Path:
        return self.root / MARKER


def temp_name(nbytes: int) -> str:
    """A fresh temp file name of this process for a frame of ``nbytes`` bytes: the
    size in the name lets any process count the write's reservation."""
    return f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}-{nbytes}"


def shard_name(key: ChunkKey) -> str:
    return key.chunk_hash[:1].hex()


def open_dir(name: str, dir_fd: int | None) -> int:
    """Open the directory ``name`` (relative to ``dir_fd``) without following a
    symbolic link: a link (or anything but a directory) raises OSError."""
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


_NAMESPACES: dict[bytes, bytes] = {}  # one bytes object per namespace id seen in file names


def parse_chunk_name(shard: str, name: str) -> ChunkKey | None:
    """The key a file name stands for, or None when the name is not a chunk of
    this shard (a foreign file, or a chunk filed under the wrong shard). Keys of one
    namespace share its id's bytes object (an index of millions of keys holds a
    handful of namespaces)."""
    try:
        key = ChunkKey.parse(name)
    except ValueError:
        return None
    if key.chunk_hash[:1].hex() != shard:
        return None
    ns = _NAMESPACES.get(key.namespace)
    if ns is None:
        if len(_NAMESPACES) >= 1024:  # bounded: a directory full of namespaces just shares less
            return key
        ns = _NAMESPACES.setdefault(key.namespace, key.namespace)
    return ChunkKey(ns, key.chunk_hash)


def temp_owner_pid(name: str) -> int | None:
    """The pid that created a temp file (from its name), or None if malformed."""
    if not name.startswith(TMP_PREFIX):
        return None
    pid, _, _ = name[len(TMP_PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() else None


def temp_reserved_bytes(name: str) -> int:
    """The frame size a temp file name declares (0 for names without one)."""
    tail = name[len(TMP_PREFIX) :].split("-")
    return int(tail[2]) if len(tail) == 3 and tail[2].isdigit() else 0


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
