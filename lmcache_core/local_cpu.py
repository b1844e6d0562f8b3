"""The CPU tier (``local_cpu``): chunks live in the engine's memory pool, evicted within
a byte budget in the order of the tier's eviction policy (``eviction:``, see
:mod:`lmcache_core.eviction`), and a chunk pinned by an in-flight load is never
evicted whatever the policy says."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

import torch
from pydantic import Field

from .backend import PINNING, ZERO_COPY, BackendContext, BackendStats, EraseMatch, StorageBackend, prefix_count, remove_each
from .config import ByteSize, StrictModel, parse_size, validate_section
from .eviction import EvictionPolicy, LruPolicy, PolicyRegistry
from .keys import ChunkKey
from .memory import MemoryBuffer, MemoryPool
from .retention import Retention


DEFAULT_EVICTION = "adaptive"


class LocalCpuConfig(StrictModel):
    max_size: ByteSize = 1 << 30
    eviction: str = DEFAULT_EVICTION
    retention_share: float = Field(0.5, ge=0.0, le=0.9)


class LocalCpuBackend(StorageBackend):
    name = "local_cpu"
    capabilities = frozenset({ZERO_COPY, PINNING})

    def __init__(
        self, pool: MemoryPool, max_size: int, policy: EvictionPolicy | None = None, retention_share: float = 0.5
    ) -> None:
        self.pool = pool
        self.max_size = min(max_size, pool.capacity)
        self._lock = threading.RLock()
        self.policy = policy if policy is not None else LruPolicy(self.max_size)
        # retention hints (lmcache_core.retention): honoured whatever the policy
        self.retention: Retention[ChunkKey] = Retention(self.max_size, retention_share)
        # key -> the pool buffer holding the chunk (one reference held by the tier);
        # pins apart, for the few keys that have them (a small per-entry footprint)
        self._entries: dict[ChunkKey, MemoryBuffer] = {}
        self._pins: dict[ChunkKey, int] = {}
        self._bytes = 0
        self._stats = BackendStats(self.name, bytes_capacity=self.max_size)
        self._stats.extra["eviction"] = self.policy.name
        self._stats.extra["rejected"] = 0  # puts the policy's admission filter declined

    # -- contract -------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return prefix_count(keys, self._entries)

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        with self._lock:
            if key in self._entries:
                self.policy.hit(key)
                return True
        buf = self.allocate(tuple(data.shape), data.dtype)
        if buf is None:
            with self._lock:
                self._stats.skipped += 1
            return False
        try:
            buf.tensor.copy_(data)
            return self.put_buffer(key, buf)
        finally:
            buf.release()

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        buf = self.get_buffer(key)
        if buf is None:
            return False
        try:
            if buf.dtype != out.dtype or buf.shape != tuple(out.shape):
                with self._lock:
                    self._stats.errors += 1
                return False
            out.copy_(buf.tensor)
            return True
        finally:
            buf.release()

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            buf = self._entries.pop(key, None)
            if buf is None:
                return False
            self.policy.remove(key)
            self.retention.forget(key)
            self._bytes -= buf.size
            # its pins stay: they are holds the pinning requests release later (a
            # count dropped here would let such a release take another request's pin
            # on the chunk stored again)
        buf.release()
        return True

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """Drop every chunk ``match`` takes (``lmcache-core erase`` reaches a running
        engine's CPU tier through :mod:`lmcache_core.control`); reported to the
        eviction listeners like evictions (KV events). A load holding a chunk's buffer
        finishes with its copy; later lookups miss."""
        with self._lock:
            keys = [k for k in self._entries if match(k)]
        if dry_run:
            return len(keys)

        def gone(key: ChunkKey) -> bool:
            if not self.remove(key):
                return False
            self.evicted(key)
            return True

        return remove_each(gone, keys, progress)

    def stats(self) -> BackendStats:
        with self._lock:
            s = self._stats.snapshot()
            s.chunks = len(self._entries)
            s.bytes_used = self._bytes
            s.extra["pinned"] = sum(1 for k in self._pins if k in self._entries)
            s.extra.update(self.retention.stats())
        return s

    def close(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            for key in self._entries:
                self.policy.remove(key)
                self.retention.forget(key)
            self._entries.clear()
            self._pins.clear()
            self._bytes = 0
        for buf in entries:
            buf.release()

    # -- zero copy ------------------------------------------------------------------
    def get_buffer(self, key: ChunkKey) -> MemoryBuffer | None:
        with self._lock:
            buf = self._entries.get(key)
            if buf is None:
                self._stats.misses += 1
                self.policy.miss(key)
                return None
            self.policy.hit(key)
            self._stats.hits += 1
            self._stats.get_bytes += buf.nbytes
            return buf.retain()

    def put_buffer(self, key: ChunkKey, buf: MemoryBuffer) -> bool:
        if buf.pool is not self.pool:
            return self.put(key, buf.tensor)
        with self._lock:
            if key in self._entries:
                self.policy.hit(key)
                return True
            size = buf.size
            if size > self.max_size:
                self._stats.skipped += 1
                return False
            need = self._bytes + size - self.max_size
            if need > 0 and not self.policy.admit(key, size):
                self._stats.skipped += 1
                self._stats.extra["rejected"] += 1
                return False
            self._evict_locked(need)
            if self._bytes + size > self.max_size:
                self._stats.skipped += 1
                return False
            self._entries[key] = buf.retain()
            self.policy.insert(key, size)
            self.retention.arrived(key, size)
            self._bytes += size
            self._stats.puts += 1
            self._stats.put_bytes += buf.nbytes
        return True

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> MemoryBuffer | None:
        """A pool buffer, evicting unpinned chunks (policy order) when the pool is full."""
        buf = self.pool.allocate(shape, dtype)
        while buf is None:
            if not self.evict_for(1):
                return None
            buf = self.pool.allocate(shape, dtype)
        return buf

    def evict_for(self, nbytes: int) -> int:
        with self._lock:
            return self._evict_locked(nbytes)

    def _evict_locked(self, nbytes: int) -> int:
        """Evict in policy order until ``nbytes`` are freed; pinned victims go back to
        the policy. At most one offer per resident chunk, so a pinned tier stops."""
        freed = 0
        if nbytes <= 0:
            return 0
        kept: list[ChunkKey] = []
        for _ in range(len(self._entries)):
            if freed >= nbytes:
                break
            key = self.policy.pop_victim()
            if key is None:
                break
            if not isinstance(key, ChunkKey):  # policies hold any hashable: this tier gives them chunk keys
                continue
            buf = self._entries.get(key)
            if buf is None:  # the policy offered a key the tier does not hold
                continue
            if key in self._pins or self.retention.protects(key):
                kept.append(key)
                continue
            del self._entries[key]
            self._bytes -= buf.size
            self._stats.evictions += 1
            freed += buf.size
            buf.release()
            self.evicted(key)
        for key in kept:
            self.policy.keep(key, self._entries[key].size)
        return freed

    # -- retention hints ------------------------------------------------------------
    def retain(self, keys: Sequence[ChunkKey], seconds: float, priority: int) -> int:
        def size_of(key: ChunkKey) -> int | None:
            buf = self._entries.get(key)
            return None if buf is None else buf.size

        with self._lock:
            return self.retention.add(keys, seconds, priority, size_of)

    # -- hints for the policy ---------------------------------------------------------
    def hint_chain(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            self.policy.chain(keys)

    def hint_partial(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._entries:
                self.policy.partial(key)

    # -- pinning --------------------------------------------------------------------
    def pin(self, keys: Sequence[ChunkKey]) -> None:
        """One hold on each of ``keys``, resident or not (a chunk evicted between a
        lookup's check and its pin, or removed and stored again while held, is
        counted like any other): every pin is undone by exactly one :meth:`unpin`, so
        one request's release never takes another's hold. Holds are bounded by the
        requests in flight (:class:`~lmcache_core.pins.PinBook` releases each once)."""
        with self._lock:
            pins = self._pins
            for k in keys:
                pins[k] = pins.get(k, 0) + 1

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            pins = self._pins
            for k in keys:
                n = pins.get(k)
                if n is not None:
                    if n > 1:
                        pins[k] = n - 1
                    else:
                        del pins[k]


def pool_bytes(section: Mapping[str, Any]) -> int:
    """The pool memory a ``local_cpu`` tier declares (its ``max_size``), read before the
    tier exists so the engine can size the pool; a ValueError naming ``max_size`` and
    the value when it does not parse."""
    try:
        return parse_size(section.get("max_size", LocalCpuConfig().max_size))
    except ValueError as err:
        raise ValueError(f"max_size: {err}") from None


def checked_section(
    section: Mapping[str, Any], key_path: str, source: str, plugins: PolicyRegistry, capacity: int
) -> tuple[LocalCpuConfig, EvictionPolicy]:
    """A ``local_cpu`` section validated, and its eviction policy for at most
    ``capacity`` bytes: a :class:`~lmcache_core.config.ConfigError` naming the key
    otherwise (what the tier checks before it opens, and ``lmcache-core config`` too)."""
    cfg = validate_section(LocalCpuConfig, section, key_path, source)
    size = min(cfg.max_size, capacity)
    return cfg, plugins.create_eviction_policy(cfg.eviction, size, key_path=f"{key_path}.eviction", source=source)


def create_local_cpu(section: Mapping[str, Any], ctx: BackendContext) -> LocalCpuBackend:
    from .plugins import get_plugin_manager

    plugins = ctx.plugins or get_plugin_manager()
    cfg, policy = checked_section(section, ctx.key_path, ctx.source, plugins, ctx.pool.capacity)
    return LocalCpuBackend(ctx.pool, cfg.max_size, policy, cfg.retention_share)
