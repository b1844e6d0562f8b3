"""What a lookup answers on the worker: how many of a request's chunks the cache
holds *and* are worth loading, pinned until the load, with whether the load should
leave vLLM's forward path.

Built once the engine exists (``register_kv_caches``); the scheduler side reaches it
over the lookup socket (or inline, see lookup_ipc.py). Decided here, in one call:

* the hit in every tier, pinned under the request's id;
* ``connector.load_policy: faster_than_recompute``: the prefix whose predicted load beats
  recomputing it (load_policy.py); the chunks past it are unpinned, counted bypassed;
* models with a boundary object (sliding-window pages, recurrent states): the longest
  prefix whose boundary is also held, that boundary pinned next to the chunks;
* ``connector.async_loads: auto``: whether a tier slower than memory serves the hit, and then
  its read into the CPU tier starts now (prefetch), before vLLM schedules the load;
* sub-chunk hits (subchunks.py): when the scheduler offers a stored chunk for the
  chunk right after the hit, whether it is present (pinned with the hit: ``tail``).
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

import torch

from lmcache_core import metrics

from ..engine_api import ConnectorEngine
from ..layouts.groups import boundary_hash
from .load_policy import ALWAYS, REPROBE_S, PrefillModel, best_prefix
from ..log import get_logger
from ..protocol.lookup_ipc import LookupAnswer

log = get_logger(__name__)

MAX_BOUNDARY_PROBES = 64
#: async_loads: auto loads a hit in the background when reading it from a tier slower
#: than memory is predicted to take longer than this (or has not been measured yet)
ASYNC_LOAD_S = 0.005


class HitPlanner:
    def __init__(
        self,
        engine: ConnectorEngine,
        *,
        chunk_size: int,
        chunk_shape: tuple[int, ...],
        chunk_dtype: torch.dtype,
        load_policy: str,
        load_margin: float,
        prefill: PrefillModel,
        boundary: bool,
        background: bool,
    ) -> None:
        """``boundary``: chunks restore only with their boundary object;
        ``background``: ``connector.async_loads: auto`` with a load thread to send slow hits to."""
        self.engine = engine
        self.chunk_size = chunk_size
        self.chunk_shape = chunk_shape
        self.chunk_dtype = chunk_dtype
        self.chunk_bytes = int(torch.Size(chunk_shape).numel()) * torch.empty((), dtype=chunk_dtype).element_size()
        self.load_policy = load_policy
        self.load_margin = load_margin
        self.prefill = prefill
        self.boundary = boundary
        self.background = background
        self._lock = threading.Lock()
        self.bypassed_tokens = 0
        self.bypassed_lookups = 0

    def lookup(self, hashes: Sequence[bytes], pin_id: str | None, alts: Mapping[int, bytes] | None = None) -> LookupAnswer:
        """The chunks to load from the first (pinned under ``pin_id``), whether that needs
        a slower tier (``slow``) and whether the chunk offered after the hit is present
        (``tail``). ``alts[i]``: a stored chunk offered for chunk ``i`` (a sub-chunk hit),
        checked when the hit ends at ``i``."""
        policy = self.load_policy != ALWAYS and pin_id is not None
        alts = None if self.boundary else alts
        if not self.boundary and not self.background and not policy and not alts:
            return LookupAnswer(self.engine.lookup_hashes(hashes, pin_id=pin_id))
        runs = self.engine.lookup_runs(hashes, pin_id=pin_id, record=False)
        n = sum(c for _, c in runs)
        k = self._worth_loading(hashes, runs, pin_id) if policy and pin_id is not None else n
        if self.boundary and k:
            k = n = self._restorable(hashes, k, pin_id)
        tail = alts is not None and k == n and k in alts and self._tail(alts[k], pin_id)
        self.engine.record_lookup(len(hashes), n)
        slow = self.background and self.slow(runs, k)
        if slow and pin_id is not None:
            # Start reading the hit into the CPU tier now: vLLM schedules its load a
            # step or more later (after allocating blocks), and the load then waits for
            # this read instead of making its own. (An offered chunk after the hit may
            # be a partial one, of a size only the scheduler knows: the load reads it.)
            self.engine.prefetch(hashes[:k], [self.chunk_shape] * k, self.chunk_dtype, owner=pin_id)
        return LookupAnswer(k, slow, tail)

    def _tail(self, alt: bytes, pin_id: str | None) -> bool:
        """Whether stored chunk ``alt``, offered after the hit, is present (then pinned
        with the hit)."""
        return self.engine.lookup_hashes([alt], pin_id=pin_id, record=False, add_pins=True) == 1

    def slow(self, runs: Sequence[tuple[int, int]], k: int) -> bool:
        """Whether loading the first ``k`` chunks needs a tier slower than memory: one
        that is not the zero-copy CPU tier and whose measured reads of that many bytes
        take longer than ``ASYNC_LOAD_S`` (or have not been measured yet). Such a load
        goes to the load thread (``connector.async_loads: auto``), off vLLM's forward path."""
        left = k
        for level, count in runs:
            if left <= 0:
                break
            take = min(count, left)
            left -= take
            cost = self.engine.read_estimate(level, take * self.chunk_bytes)
            if cost.zero_copy:
                continue
            seconds = cost.seconds
            if seconds is None or seconds > ASYNC_LOAD_S:
                return True
        return False

    def _worth_loading(self, hashes: Sequence[bytes], runs: list[tuple[int, int]], pin_id: str) -> int:
        """``faster_than_recompute``: the hit prefix worth loading; the chunks past it
        are unpinned and counted as bypassed."""
        per_chunk: list[float] = []
        for level, count in runs:
            cost = self.engine.read_estimate(level, self.chunk_bytes)
            fresh = cost.age is not None and cost.age <= REPROBE_S
            s = cost.seconds if fresh else None
            per_chunk += [s or 0.0] * count  # never read (or not lately): load once to measure
        n = len(per_chunk)
        k = best_prefix(per_chunk, self.chunk_size, self.prefill, self.load_margin)
        if k < n:
            self.engine.pins.keep(pin_id, k)  # only what loads stays pinned
            tokens = (n - k) * self.chunk_size
            with self._lock:
                self.bypassed_tokens += tokens
                self.bypassed_lookups += 1
            metrics.BYPASSED_TOKENS.inc(tokens)
            log.debug(
                "lookup %s: loading %d of %d hit chunks (predicted load %.1f ms, recompute %.1f ms)",
                pin_id,
                k,
                n,
                1000 * sum(per_chunk),
                1000 * (self.prefill.recompute_seconds(n * self.chunk_size) or 0.0),
            )
        return k

    def _restorable(self, hashes: Sequence[bytes], n: int, pin_id: str | None) -> int:
        """The longest prefix of ``n`` present chunks that also has its boundary object
        (window pages / states): the boundaries of the ``MAX_BOUNDARY_PROBES`` longest
        prefixes probed in one call (:meth:`CacheEngine.probe_boundary`), the one found
        pinned with the chunks, the chunks past it released."""
        lengths = list(range(n, max(0, n - MAX_BOUNDARY_PROBES), -1))
        i = self.engine.probe_boundary([boundary_hash(hashes[k - 1]) for k in lengths], pin_id)
        if i < 0:
            if pin_id is not None:
                self.engine.pins.release(pin_id)
            return 0
        if pin_id is not None:
            self.engine.pins.keep(pin_id, lengths[i])
        return lengths[i]
