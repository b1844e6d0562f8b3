"""The disk tier's index layer: what this process knows of the directory.

:class:`Catalog` keeps the in-memory index (:mod:`.index`: LRU, or an eviction
policy's) and, while the background start-up scan runs (startup.py), the chunks it
has found so far (a heap in mtime order: the eviction victims meanwhile), then
merges them below the chunks this process used; a relisting of the directory
replaces the index. Every method runs under ``_lock`` unless it says otherwise.
"""

from __future__ import annotations

import heapq

from lmcache_core.keys import ChunkKey

from .access import DirAccess
from .index import LruIndex, PolicyIndex
from .scan import ScanResult


class Catalog(DirAccess):
    """The index and the start-up scan's found chunks."""

    def _new_index(self) -> LruIndex:
        """An empty index: LRU, or driven by the configured eviction policy."""
        return LruIndex() if self._make_policy is None else PolicyIndex(self._make_policy)

    def _merge_found(self) -> None:
        """Make the scanned chunks the least recently used part of the index, oldest
        mtime first, below the chunks this process used during the scan."""
        with self._lock:
            order = self._found_heap
            self._found_heap = []
        order.sort()
        with self._lock:
            merged = self._new_index()
            found, current = self._found, self._index
            for _, _, key in order:
                size = found.get(key)
                if size is not None and key not in current:
                    merged.add(key, size)
            for key, size in current.items():
                merged.add(key, size)
            self._index = merged
            self._found, self._found_bytes = {}, 0
            self._dropped = set()
            self._indexing = False

    def _forget(self, key: ChunkKey) -> None:
        """Drop ``key`` from the index (it is gone from the directory). Call under
        ``self._lock``."""
        self._index.discard(key)
        if self._indexing:
            self._found_bytes -= self._found.pop(key, 0)
            self._dropped.add(key)

    def _used(self, key: ChunkKey, size: int, *, fresh: bool = False) -> None:
        """``key`` (``size`` bytes on disk) was just read or written: most recently
        used. ``fresh``: a new file (its size may differ). Call under ``self._lock``."""
        if fresh or not self._index.touch(key):
            self._index.add(key, size)
        if self._found:
            self._found_bytes -= self._found.pop(key, 0)

    def _pop_victims(self, nbytes: int) -> list[tuple[ChunkKey, int]]:
        """Least recently used entries freeing ``nbytes``: during the scan the oldest
        chunks scanned so far come first (older than any this process used since it
        started). Call under ``self._lock``."""
        out: list[tuple[ChunkKey, int]] = []
        freed = 0
        heap = self._found_heap
        while freed < nbytes and heap:
            _, _, key = heapq.heappop(heap)
            size = self._found.pop(key, None)
            if size is None:
                continue
            self._found_bytes -= size
            if key in self._index:
                continue
            out.append((key, size))
            freed += size
        if freed < nbytes:
            out.extend(self._index.pop_lru(nbytes - freed))
        return out

    def _load_listing(self, listing: ScanResult) -> None:
        """Make a listing of the whole directory the index (oldest mtime first)."""
        with self._lock:
            self._index = self._new_index()
            self._index.load(listing.entries)
            self._found, self._found_heap, self._found_bytes = {}, [], 0  # all in the listing

    def _take_found(self, entries: list[tuple[ChunkKey, int, int]], seq: int) -> int:
        """Add a scanned shard's chunks to the found ones (not those dropped or
        indexed meanwhile); returns the next sequence number. Call under ``self._lock``."""
        for key, size, mtime in entries:
            if key in self._dropped or key in self._index:
                continue
            self._found_bytes += size - self._found.get(key, 0)
            self._found[key] = size
            heapq.heappush(self._found_heap, (mtime, seq, key))
            seq += 1
        return seq

    def _note_seen(self, key: ChunkKey, size: int) -> None:
        """``contains`` saw ``key``'s file: index it if this process did not know it."""
        if key not in self._index and key not in self._found:  # unlocked reads of dicts: atomic
            with self._lock:
                if key not in self._index and key not in self._found:
                    self._index.add(key, size)
