"""Correctness canary, connector side: which hits to recompute, and how a stored
chunk is compared with its recomputation.

A sampled request's hit is not loaded (the scheduler reports no external tokens),
so vLLM computes those tokens; when the worker gathers them for saving, it hands
each chunk to :meth:`lmcache_core.engine.CacheEngine.verify`, which reads the stored
objects from every tier holding them and compares them with :func:`compare`. The
engine charges mismatches to tiers and quarantines (see :mod:`lmcache_core.quarantine`).

Sampling is deterministic: a request with a hit is verified when a keyed hash of its
last hit chunk and the scheduler's running count of hit requests falls below
``verify_fraction``. The same sequence of requests is sampled the same way in
every run (tests reproduce), yet neither a hot prefix nor a periodic workload is
always or never sampled. ``lmcache.verify: true|false`` in a request's
``kv_transfer_params`` overrides the sampling for that request.

Comparison: byte-identical is a match. Otherwise, for floating-point KV, the
relative error ``||stored - fresh|| / ||fresh||`` (over the whole chunk, in float64)
must be within the dtype's tolerance in :data:`TOLERANCE`. vLLM-CPU recomputes the
same prefix bit for bit in our measurements (docs/canary.md), but a different batch
composition or prefill split may change the order of floating-point reductions on
other builds and hardware, flipping low bits; wrong objects (another key's chunk,
another layout, another model) are off by orders of magnitude more.
"""

from __future__ import annotations

import hashlib

import torch

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
