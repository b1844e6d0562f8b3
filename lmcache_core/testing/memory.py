"""The in-memory reference tier: a real :class:`~lmcache_core.backend.StorageBackend`
held in a dict, for tests and benchmarks that need a tier of their own (as fsspec
ships ``MemoryFileSystem``).

It keeps the whole contract, so it passes :class:`~lmcache_core.testing.BackendConformance`:
a prefix ``contains``, copies in and out, a wrong shape or dtype is a miss, an
existing key is a no-op, a byte budget (``max_size``) held by evicting the least
recently used chunks (each reported through :meth:`~StorageBackend.evicted`), counted
stats, thread safety, :meth:`~StorageBackend.erase`. With a ``codec`` it keeps serde
frames, as a plugin tier over a byte store does: written with the tier's codec (sealed
when the deployment has a ``frame_secret``), read back with ``try_decode``, so a
corrupt, foreign or planted frame is a miss.

Knobs for what a test injects (all off by default): ``get_delay_s`` (every read
waits, a tier far away), ``put_gate`` (every write waits until the event is set, a
tier as slow as the test wants), ``down`` (every call raises ``ConnectionError``, a
tier whose server is down; settable at any time), ``shared`` (declares ``SHARED``).

``data`` (key to tensor, or to frame bytes with a codec) is public for tests that
inspect the storage; :meth:`plant` writes into it behind the tier's back (a corrupt
chunk, another client's frame) with the byte count kept right.

Register it for an engine with :class:`MemoryTierPlugin`::

    pm = PluginManager(load_entry_points=False)
    pm.register(MemoryTierPlugin("memory"), name="memory-tier")
    config: backends: [{name: local_cpu}, {name: memory, max_size: 64MiB, get_delay_ms: 5}]
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import torch
from pydantic import Field

from ..backend import SHARED, BackendContext, BackendStats, EraseMatch, StorageBackend, prefix_count
from ..config import ByteSize, StrictModel, validate_section
from ..hookspecs import RegisterBackend, hookimpl
from ..keys import ChunkKey
from ..serde import Codec, encode, try_decode

DEFAULT_MAX_SIZE = 1 << 30


class MemoryTierConfig(StrictModel):
    """A ``backends:`` entry for the reference tier."""

    max_size: ByteSize = DEFAULT_MAX_SIZE
    #: keep serde frames of the tier's codec instead of tensor copies
    frames: bool = False
    shared: bool = False
    get_delay_ms: float = Field(0.0, ge=0.0)


def _nbytes(value: torch.Tensor | bytes) -> int:
    return value.nbytes if isinstance(value, torch.Tensor) else len(value)


class MemoryTier(StorageBackend):
    """A dict of chunks within ``max_size`` bytes, least recently used evicted first.
    See the module docstring for the knobs; ``name`` overrides the class's."""

    name = "memory"

    def __init__(
        self,
        *,
        name: str | None = None,
        max_size: int = DEFAULT_MAX_SIZE,
        codec: Codec | None = None,
        codecs: Mapping[str, Codec] | None = None,
        shared: bool = False,
        get_delay_s: float = 0.0,
        put_gate: threading.Event | None = None,
        down: bool = False,
    ) -> None:
        if name is not None:
            self.name = name
        if shared:
            self.capabilities = frozenset({SHARED})
        if codec is not None and codecs is None:
            raise ValueError("MemoryTier: a codec to write frames needs the codecs to read them (codecs=)")
        self.max_size = max_size
        self.codec = codec
        self.codecs = dict(codecs) if codecs is not None else None
        self.get_delay_s = get_delay_s
        self.put_gate = put_gate
        self.down = down
        #: the stored chunks, least recently used first (tensors, or frames with a codec)
        self.data: OrderedDict[ChunkKey, Any] = OrderedDict()
        #: guards ``data`` and the counters; held only for dict work, never while waiting
        self.lock = threading.RLock()
        self._bytes = 0
        self._stats = BackendStats(self.name, bytes_capacity=max_size)

    def _check_up(self) -> None:
        if self.down:
            raise ConnectionError(f"tier {self.name} is down")

    # -- contract -------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        self._check_up()
        with self.lock:
            return prefix_count(keys, self.data)

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        self._check_up()
        with self.lock:
            return next((i for i, k in enumerate(keys) if k in self.data), -1)

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        self._check_up()
        if self.put_gate is not None:
            self.put_gate.wait()
        with self.lock:
            if key in self.data:
                self.data.move_to_end(key)
                return True
        value: Any = encode(key, data, self.codec) if self.codec is not None else data.detach().clone()
        size = _nbytes(value)
        evicted: list[ChunkKey] = []
        with self.lock:
            if size > self.max_size:
                self._stats.skipped += 1
                return False
            if key in self.data:  # stored by another thread meanwhile
                return True
            while self._bytes + size > self.max_size:
                old, old_value = self.data.popitem(last=False)
                self._bytes -= _nbytes(old_value)
                self._stats.evictions += 1
                evicted.append(old)
            self.data[key] = value
            self._bytes += size
            self._stats.add(puts=1, put_bytes=data.nbytes)
        for old in evicted:
            self.evicted(old)
        return True

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        self._check_up()
        if self.get_delay_s > 0:
            time.sleep(self.get_delay_s)
        with self.lock:
            value = self.data.get(key)
            if value is not None:
                self.data.move_to_end(key)
        if value is None:
            ok = False
        elif self.codecs is not None:
            ok = try_decode(value, self.codecs, expect_key=key, out=out).ok
        elif isinstance(value, torch.Tensor) and value.shape == out.shape and value.dtype == out.dtype:
            out.copy_(value)
            ok = True
        else:
            ok = False
        with self.lock:
            if ok:
                self._stats.add(hits=1, get_bytes=out.nbytes)
            else:
                self._stats.misses += 1
        return ok

    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        self._check_up()
        return super().get_many(keys, outs)

    def put_many(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[bool]:
        self._check_up()
        return super().put_many(items)

    def remove(self, key: ChunkKey) -> bool:
        self._check_up()
        with self.lock:
            value = self.data.pop(key, None)
            if value is None:
                return False
            self._bytes -= _nbytes(value)
            return True

    def stats(self) -> BackendStats:
        self._check_up()
        with self.lock:
            s = self._stats.snapshot()
            s.chunks = len(self.data)
            s.bytes_used = self._bytes
            return s

    def close(self) -> None:
        self._check_up()
        with self.lock:
            self.data.clear()
            self._bytes = 0

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        self._check_up()
        with self.lock:
            doomed = [k for k in self.data if match(k)]
        if not dry_run:
            for k in doomed:
                self.remove(k)
        if progress is not None:
            progress(len(doomed))
        return len(doomed)

    # -- for tests ------------------------------------------------------------------
    def count(self, **counts: int) -> None:
        """Add to the tier's stats (``BackendStats.add``): a subclass's own counters
        (a fault it injected) land in ``stats().extra``."""
        with self.lock:
            self._stats.add(**counts)

    def plant(self, key: ChunkKey, value: torch.Tensor | bytes) -> None:
        """Store ``value`` (a tensor, or a frame with a codec) for ``key`` as is,
        bypassing the tier: no copy, no check, no eviction, not counted as a put (what
        another client of a shared store, or a damaged medium, would leave there)."""
        with self.lock:
            old = self.data.pop(key, None)
            if old is not None:
                self._bytes -= _nbytes(old)
            self.data[key] = value
            self._bytes += _nbytes(value)


class MemoryTierPlugin:
    """A plugin registering the reference tier under ``name``: each ``backends:``
    entry of that name builds one (:class:`MemoryTierConfig` for its keys), with
    ``knobs`` (:class:`MemoryTier`'s keyword arguments) as defaults for all of them.
    Keeps what it built in ``created``, in order."""

    def __init__(self, name: str = "memory", **knobs: Any) -> None:
        self.name = name
        self.knobs = knobs
        self.created: list[MemoryTier] = []

    def create(self, section: Mapping[str, Any], ctx: BackendContext) -> MemoryTier:
        cfg = validate_section(MemoryTierConfig, section, ctx.key_path, ctx.source)
        kw: dict[str, Any] = {"name": self.name, **self.knobs}
        if "max_size" in section:
            kw["max_size"] = cfg.max_size
        if cfg.frames:
            kw.update(codec=ctx.codec, codecs=ctx.codecs)
        if cfg.shared:
            kw["shared"] = True
        if "get_delay_ms" in section:
            kw["get_delay_s"] = cfg.get_delay_ms / 1000
        tier = MemoryTier(**kw)
        self.created.append(tier)
        return tier

    @hookimpl
    def register_backends(self, register: RegisterBackend) -> None:
        register(self.name, self.create, description="the in-memory reference tier (lmcache_core.testing.memory)")
