"""Keys known to be present in the bucket, so repeated lookups cost no request.

Only positive knowledge is kept: another instance may store a chunk at any moment,
so a miss is never remembered. Entries expire after ``ttl_s`` (another instance or a
lifecycle rule may delete objects) and the oldest go first past ``max_entries``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from lmcache_core.keys import ChunkKey


class PresenceCache:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._seen: OrderedDict[ChunkKey, float] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        if self.max_entries == 0 or not isinstance(key, ChunkKey):
            return False
        with self._lock:
            t = self._seen.get(key)
            if t is None:
                return False
            if time.monotonic() - t > self.ttl_s:
                del self._seen[key]
                return False
            self._seen.move_to_end(key)
            return True

    def add(self, key: ChunkKey) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            self._seen[key] = time.monotonic()
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)

    def discard(self, key: ChunkKey) -> None:
        with self._lock:
            self._seen.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
