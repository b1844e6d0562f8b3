"""In-memory index of the chunk files one process knows about: key -> size, in LRU
order, with the byte total. Not thread-safe on its own; the backend holds its lock.

The index is a cache of the directory, rebuilt from it at start-up (ordered by file
mtime, which ``get`` refreshes), so the LRU order survives restarts.

``eviction: lru`` (the default) evicts in that order (:class:`LruIndex`); any other
eviction policy (``s3fifo``, ``tinylfu``, a plugin's: the same ones the CPU tier
takes, :mod:`lmcache_core.eviction`) chooses the victims of a :class:`PolicyIndex`,
which keeps the recency order for restarts and merges. The policy sees this
process's accesses only; other processes sharing the directory keep their own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

from lmcache_core.eviction import EvictionPolicy
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


class PolicyIndex(LruIndex):
    """An :class:`LruIndex` whose victims an eviction policy chooses (the recency
    order is kept for :meth:`items`: restarts and the start-up merge)."""

    def __init__(self, make_policy: Callable[[], EvictionPolicy]) -> None:
        super().__init__()
        self.policy = make_policy()

    def add(self, key: ChunkKey, size: int) -> None:
        old = self._sizes.get(key)
        super().add(key, size)
        if old is None:
            self.policy.insert(key, size)
        elif old != size:  # a new file of another size: a new chunk to the policy
            self.policy.remove(key)
            self.policy.insert(key, size)
        else:
            self.policy.hit(key)

    def touch(self, key: ChunkKey) -> bool:
        if super().touch(key):
            self.policy.hit(key)
            return True
        return False

    def discard(self, key: ChunkKey) -> int | None:
        size = super().discard(key)
        if size is not None:
            self.policy.remove(key)
        return size

    def pop_lru(self, nbytes: int) -> list[tuple[ChunkKey, int]]:
        """The policy's victims until ``nbytes`` are freed (or none is left)."""
        out: list[tuple[ChunkKey, int]] = []
        freed = 0
        for _ in range(len(self._sizes) + 1):
            if freed >= nbytes or not self._sizes:
                break
            key = self.policy.pop_victim()
            if key is None:
                break
            size = self._sizes.pop(key, None)  # type: ignore[call-overload]
            if size is None:  # not a key of this index
                continue
            self.bytes -= size
            freed += size
            out.append((key, size))
        if freed < nbytes:  # the policy ran dry: the least recent of what is left
            rest = super().pop_lru(nbytes - freed)
            for key, _ in rest:
                self.policy.remove(key)
            out += rest
        return out
