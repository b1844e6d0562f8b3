"""Preload: a starting engine reads the chunks its slower tiers hold for its own key
namespace into its memory tier, in the background, so that the first request about a
document warmed earlier (``lmcache-core warm``, or a previous run) loads from memory
as a second visit would, instead of from disk.

Bounded and harmless by construction:

- off unless the config's ``preload`` gives a byte budget; at most that many bytes,
  and never more than the memory tier has free: a preload never evicts a chunk (it
  stops at the first one whose pool-aligned size does not fit, checked before each
  read) and never takes a pool buffer the pool cannot give without eviction;
- only tiers that list what they hold (:meth:`StorageBackend.stored_chunks`, e.g.
  ``disk``): the newest that fit are chosen, then read oldest first, so the newest
  end as the memory tier's most recently used; only chunks of this namespace whose stored
  dtype is the engine's and whose size is at most one whole chunk's; the shape a tier
  reports is only a hint: the read verifies the frame as every read does (a lying
  header is a miss), and the memory tier serves a chunk only to a load of that exact
  shape and dtype;
- one background thread at the background threads' priority; :meth:`Preloader.close`
  stops it at its next chunk (the engine's close waits for it at most a deadline);
- a failing tier or listing ends that tier's part (logged, counted), never the engine.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from .backend import StoredChunk
from .memory import MemoryBuffer, pool_size
from .tiers import Tier, TierStack

log = logging.getLogger(__name__)


@dataclass
class PreloadResult:
    """What a preload did (``stopped``: why it ended)."""

    chunks: int = 0
    bytes: int = 0
    #: listed but not taken: another dtype, larger than a chunk, or the read missed
    skipped: int = 0
    #: listed and already in the memory tier
    present: int = 0
    seconds: float = 0.0
    stopped: str = "running"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"preload: {self.chunks} chunks ({self.bytes / 2**20:.1f} MiB) into the memory tier in {self.seconds:.1f} s "
            f"({self.present} already there, {self.skipped} skipped); {self.stopped}"
        )


class Preloader:
    """Reads ``namespace``'s chunks from the slower tiers of ``stack`` into its first
    (memory) tier, at most ``budget`` bytes; see the module's notes."""

    def __init__(
        self,
        stack: TierStack,
        namespace: bytes,
        dtype: torch.dtype,
        max_chunk_bytes: int,
        budget: int,
        *,
        initializer: Callable[[], None] | None = None,
        on_done: Callable[[PreloadResult], None] | None = None,
    ) -> None:
        """``initializer``: called first in the thread (priority, cores); ``on_done``:
        called with the result at the end (an embedding's own log)."""
        self.stack = stack
        self.namespace = namespace
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.max_chunk_bytes = max_chunk_bytes
        self.budget = budget
        self.result = PreloadResult()
        self.done = threading.Event()
        self._stop = threading.Event()
        self._initializer = initializer
        self._on_done = on_done
        self._thread = threading.Thread(target=self._main, name="lmcache-preload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Stop at the next chunk; wait for the thread at most ``timeout`` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._initializer is not None:
                self._initializer()
            with torch.inference_mode():
                self.result.stopped = self._run()
        except Exception as err:  # never the engine's end: what was read stays
            log.warning("preload: stopped by %s: %s", type(err).__name__, err)
            self.result.stopped = f"error: {type(err).__name__}"
        finally:
            self.result.seconds = round(time.perf_counter() - t0, 3)
            self.done.set()
        log.info("%s", self.result.describe())
        if self._on_done is not None:
            try:
                self._on_done(self.result)
            except Exception as err:
                log.warning("preload: its report failed: %s: %s", type(err).__name__, err)

    def _run(self) -> str:
        top = self.stack.top
        if top is None or not top.zero_copy or not top.in_service:
            return "no memory tier"
        for tier in list(self.stack)[1:]:
            if not tier.in_service or not self.stack.takes_from(top, tier):
                continue
            try:
                listing = tier.backend.stored_chunks(self.namespace)
            except Exception as err:
                tier.error("list", err)
                continue
            if listing is not None:
                stopped = self._take(top, tier, listing)
                if stopped:
                    return stopped
        return "every listed chunk read"

    def _take(self, top: Tier, tier: Tier, listing: Iterable[StoredChunk]) -> str | None:
        """Read the chunks :meth:`_choose` takes from ``tier`` into ``top``, the oldest
        first, so that the newest end as the memory tier's most recently used (the
        last its eviction takes); why the preload ends, or None when this tier's
        listing is done."""
        chosen, stopped = self._choose(top, tier, listing)
        for item, nbytes in reversed(chosen):
            if self._stop.is_set():
                return "closed"
            if self._free(top) < pool_size(nbytes):
                return "memory tier full"
            buf = self.stack.pool.allocate(item.shape, self.dtype)  # the pool's own: no eviction
            if buf is None:
                return "memory pool full"
            try:
                if not self._read_into(top, tier, item, buf):
                    self.result.skipped += 1
                    continue
            finally:
                buf.release()
            self.result.chunks += 1
            self.result.bytes += nbytes
        return stopped

    def _choose(self, top: Tier, tier: Tier, listing: Iterable[StoredChunk]) -> tuple[list[tuple[StoredChunk, int]], str | None]:
        """The listed chunks to read (the newest first, as listed) and their bytes,
        within the budget left and the memory tier's free room now; why the choice
        ended before the listing did, or None."""
        chosen: list[tuple[StoredChunk, int]] = []
        total, picked, free = self.result.bytes, 0, self._free(top)
        try:
            for item in listing:
                if self._stop.is_set():
                    return chosen, "closed"
                nbytes = self._size(item)
                if nbytes is None:
                    self.result.skipped += 1
                elif top.holds(item.key):
                    self.result.present += 1
                elif total + nbytes > self.budget:
                    return chosen, "budget reached"
                elif picked + (room := pool_size(nbytes)) > free:  # the tier charges the pool's aligned size
                    return chosen, "memory tier full"
                else:
                    chosen.append((item, nbytes))
                    total += nbytes
                    picked += room
        except Exception as err:  # a listing that fails midway: what was chosen is read
            tier.error("list", err)
        return chosen, None

    def _size(self, item: StoredChunk) -> int | None:
        """The chunk's bytes, or None when it is not one this engine could load."""
        if item.key.namespace != self.namespace or item.dtype != self.dtype_name:
            return None
        if not item.shape or any(d <= 0 for d in item.shape):
            return None
        nbytes = math.prod(item.shape) * self.dtype.itemsize
        return nbytes if nbytes <= self.max_chunk_bytes else None

    @staticmethod
    def _free(top: Tier) -> int:
        """Bytes the memory tier has free without evicting anything."""
        stats = top.backend.stats()
        return sys.maxsize if stats.bytes_capacity is None else stats.bytes_capacity - stats.bytes_used

    def _read_into(self, top: Tier, tier: Tier, item: StoredChunk, buf: MemoryBuffer) -> bool:
        """Read the chunk from ``tier`` into ``buf`` and promote it as a load's read
        would (the canary learns where it came from); whether the memory tier has it."""
        if not tier.read_many([item.key], [buf.tensor])[0]:
            return False
        self.stack.promote(item.key, buf, tier)
        return top.holds(item.key)
