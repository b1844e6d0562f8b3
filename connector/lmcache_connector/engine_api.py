"""What the connector needs of the cache engine, and nothing more.

:class:`ConnectorEngine` lists every engine member the connector's worker side calls
(the hit planner, the transfers, the saver, the worker's stats): the lookup plan
(``lookup_runs``, ``probe_boundary``, ``read_estimate``, ``pins``), loads
(``iter_chunks``, ``retrieve_buffer``, ``prefetch``, ``preload``), saves (``allocate``,
``store_hashes``, ``canary``), hints, stats and life cycle. The worker builds a
:class:`~lmcache_core.engine.CacheEngine` (which satisfies it, checked by mypy at the
one place it is built) and every other connector module sees only this interface, so
an engine change that the connector does not see cannot break it, and a test may hand
the connector any object with these members.
"""

from __future__ import annotations

from typing import Callable, Generator, Protocol, Sequence

import torch

from lmcache_core.canary import Canary
from lmcache_core.engine import ChunkData, ReadEstimate, TierListener, TierReport
from lmcache_core.keys import KeyNamespace
from lmcache_core.memory import MemoryBuffer
from lmcache_core.metrics import EngineCounters
from lmcache_core.pins import PinBook
from lmcache_core.preload import PreloadResult


class ConnectorEngine(Protocol):
    namespace: KeyNamespace
    pins: PinBook
    canary: Canary
    counters: EngineCounters

    # -- the lookup plan ------------------------------------------------------------
    def lookup_hashes(
        self, hashes: Sequence[bytes], *, pin_id: str | None = None, record: bool = True, add_pins: bool = False
    ) -> int: ...

    def lookup_runs(
        self, hashes: Sequence[bytes], *, pin_id: str | None = None, record: bool = True, add_pins: bool = False
    ) -> list[tuple[int, int]]: ...

    def probe_boundary(self, hashes: Sequence[bytes], pin_id: str | None = None) -> int: ...

    def read_estimate(self, level: int, nbytes: int) -> ReadEstimate: ...

    def record_lookup(self, n_chunks: int, n_hit: int) -> None: ...

    def retain(self, hashes: Sequence[bytes], seconds: float, priority: int = 0) -> int: ...

    # -- loads ----------------------------------------------------------------------
    def iter_chunks(
        self, hashes: Sequence[bytes], shapes: Sequence[Sequence[int]], dtype: torch.dtype
    ) -> Generator[MemoryBuffer, None, None]: ...

    def retrieve_buffer(self, chunk_hash: bytes, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None: ...

    def prefetch(
        self, hashes: Sequence[bytes], shapes: Sequence[Sequence[int]], dtype: torch.dtype, owner: str | None = None
    ) -> bool: ...

    def record_load_errors(self, n_chunks: int) -> None: ...

    def preload(
        self, dtype: torch.dtype, max_chunk_bytes: int, on_done: Callable[[PreloadResult], None] | None = None
    ) -> PreloadResult | None: ...

    # -- saves ----------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None: ...

    def store_hashes(self, hashes: Sequence[bytes], chunks: Sequence[ChunkData], *, n_tokens: int | None = None) -> int: ...

    # -- events, stats, life cycle --------------------------------------------------
    def add_listener(self, listener: TierListener) -> None: ...

    def tier_report(self) -> list[TierReport]: ...

    def stats(self) -> dict[str, object]: ...

    def flush(self, timeout: float | None = 30.0) -> bool: ...

    def close(self) -> None: ...
