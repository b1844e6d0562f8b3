"""In-memory index of the chunk files one process knows about: key -> size, in LRU
order, with the byte total. Not thread-safe on its own; the backend holds its lock.

The index is a cache of the directory, rebuilt from it at start-up (ordered by file
mtime, which ``get`` refreshes), so the LRU order survives restarts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from lmcache_core.keys import ChunkKey


class LruIndex:
    def __init__(self) -> None:
        self._sizes: OrderedDict[ChunkKey, int] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._sizes

    def load(self, entries: Iterable[tuple[ChunkKey, int, int]]) -> None:
        """Add ``(key, size, access_ns)`` entries, oldest access first."""
        for key, size, _ in sorted(entries, key=lambda e: e[2]):
            self.add(key, size)

    def add(self, key: ChunkKey, size: int) -> None:
        """Insert or refresh ``key`` as most recently used."""
        old = self._sizes.pop(key, None)
        if old is not None:
            self.bytes -= old
        self._sizes[key] = size
        self.bytes += size

    def touch(self, key: ChunkKey) -> bool:
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return True
        return False

    def discard(self, key: ChunkKey) -> int | None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.bytes -= size
        return size

    def pop_lru(self, nbytes: int) -> list[tuple[ChunkKey, int]]:
        """Remove least recently used entries until ``nbytes`` are freed (or the
        index is empty); return them for the caller to delete."""
        out: list[tuple[ChunkKey, int]] = []
        freed = 0
        while freed < nbytes and self._sizes:
            key, size = self._sizes.popitem(last=False)
            self.bytes -= size
            freed += size
            out.append((key, size))
        return out

    def items(self) -> Iterable[tuple[ChunkKey, int]]:
        """``(key, size)``, least recently used first."""
        return self._sizes.items()

    def keys_lru_first(self) -> list[ChunkKey]:
        return list(self._sizes)
