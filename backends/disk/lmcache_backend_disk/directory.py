"""Where things live in the tier's directory, and what a name found there means.

::

    <path>/LMCACHE_DISK_TIER        marker: this directory belongs to a disk tier
    <path>/LMCACHE_DISK_TIER.usage  the directory's byte count, shared by its processes (see budget.py)
    <path>/LMCACHE_DISK_TIER.owners the processes using the directory: each holds a lock on the byte
                                    at its pid (see owners.py)
    <path>/LMCACHE_DISK_TIER.ns-<id>
                                    one engine namespace's record (see records.py), outside the budget
    <path>/<hh>/<key.to_str()>      one chunk frame; <hh> = first two hex chars of the chunk hash
    <path>/<hh>/.tmp-<pid>-<rand>-<bytes>
                                    a write in progress of a <bytes>-byte frame (renamed onto the
                                    chunk name when complete); <rand> is 16 hex digits, <pid> and
                                    <bytes> plain decimals (at most 10 and 20 digits)

The marker keeps the tier from ever deleting files in a directory it does not own:
a non-empty directory without it is refused. Inside the directory the tier never
follows a symbolic link: shard directories are opened with ``O_NOFOLLOW`` and every
file operation is relative to that descriptor (``DiskBackend._shard``), and the
only entries it deletes are ones whose names it gives (chunk and temp names): files
(invalid, or leftovers), and FIFOs, sockets, device nodes or empty directories that
someone put under such a name (never links).
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from lmcache_core.keys import ChunkKey

MARKER = "LMCACHE_DISK_TIER"
USAGE = "LMCACHE_DISK_TIER.usage"
OWNERS = "LMCACHE_DISK_TIER.owners"
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


# Names in the tier's temp namespace: only these are ever removed as temps. A name
# of that namespace that is not exactly temp_name's format reserves nothing.
_TEMP_NAMESPACE = re.compile(r"\.tmp-[0-9]+(?:-|\Z)")
_TEMP_NAME = re.compile(r"\.tmp-(0|[1-9][0-9]{0,9})-[0-9a-f]{16}-(0|[1-9][0-9]{0,19})")


def is_temp_name(name: str) -> bool:
    """``name`` is in the temp namespace (``.tmp-<digits>``, ``.tmp-<digits>-...``)."""
    return _TEMP_NAMESPACE.match(name) is not None


def parse_temp_name(name: str) -> tuple[int, int] | None:
    """The owner pid and the declared frame size of a temp name written by
    :func:`temp_name`, or None for any other name (digits are bounded, so parsing
    never makes a huge number)."""
    m = _TEMP_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None
