"""The transfers, dispatched: CUDA kernels for CUDA tensors when they are available,
the pure-torch reference otherwise (CPU tensors always use the reference).

Signatures and contracts: see lmcache_cuda.reference.
"""

from __future__ import annotations

from types import ModuleType
from typing import Sequence

import torch

from lmcache_cuda import reference
from lmcache_cuda.dispatch import available


def implementation(kv_caches: Sequence[torch.Tensor]) -> ModuleType:
    """The module (kernels or reference) that handles these KV tensors."""
    if len(kv_caches) > 0 and kv_caches[0].is_cuda and available():
        from lmcache_cuda import kernels

        return kernels
    return reference


def gather_tokens(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Paged KV of ``slot_mapping``'s tokens -> ``out`` ``[layers, 2, tokens, kv_heads, head_size]``."""
    return implementation(kv_caches).gather_tokens(kv_caches, slot_mapping, out)


def scatter_tokens(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, src: torch.Tensor) -> None:
    """``src`` ``[layers, 2, tokens, kv_heads, head_size]`` -> paged KV at ``slot_mapping``."""
    implementation(kv_caches).scatter_tokens(kv_caches, slot_mapping, src)


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Whole blocks ``block_ids`` of every layer -> ``out`` ``[layers, n_blocks, ...]``."""
    return implementation(kv_caches).gather_blocks(kv_caches, block_ids, out)


def scatter_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """``src`` ``[layers, n_blocks, ...]`` -> whole blocks ``block_ids`` of every layer."""
    implementation(kv_caches).scatter_blocks(kv_caches, block_ids, src)


def layer_copies(kv_caches: Sequence[torch.Tensor], index: torch.Tensor, granularity: str):
    """``index`` (slots for ``"tokens"``, block ids for ``"blocks"``) against each layer,
    checked once; ``.run(layer, buf, gather)`` copies one layer between the KV and a
    buffer ``[1, ...]`` (see kernels.LayerCopies)."""
    return implementation(kv_caches).LayerCopies(kv_caches, index, granularity)


def copy_segments(
    dsts: Sequence[torch.Tensor],
    dst_off: Sequence[int],
    srcs: Sequence[torch.Tensor],
    src_off: Sequence[int],
    nbytes: Sequence[int],
) -> None:
    """Byte-range copies between contiguous tensors on the current stream: one native
    call when the kernels are loaded and a CUDA tensor is involved, else a loop."""
    if available() and any(t.is_cuda for t in (*dsts[:1], *srcs[:1])):
        from lmcache_cuda import kernels

        kernels.copy_segments(dsts, dst_off, srcs, src_off, nbytes)
        return
    reference.copy_segments(dsts, dst_off, srcs, src_off, nbytes)


def copy_rows(
    dsts: Sequence[torch.Tensor],
    dst_off: Sequence[int],
    dst_pitch: Sequence[int],
    srcs: Sequence[torch.Tensor],
    src_off: Sequence[int],
    src_pitch: Sequence[int],
    width: Sequence[int],
    rows: Sequence[int],
) -> None:
    """``rows[i]`` rows of ``width[i]`` bytes per segment, ``dst_pitch[i]`` /
    ``src_pitch[i]`` bytes apart: one 2-D DMA each when the kernels are loaded and a
    CUDA tensor is involved, else a loop."""
    if available() and any(t.is_cuda for t in (*dsts[:1], *srcs[:1])):
        from lmcache_cuda import kernels

        kernels.copy_rows(dsts, dst_off, dst_pitch, srcs, src_off, src_pitch, width, rows)
        return
    reference.copy_rows(dsts, dst_off, dst_pitch, srcs, src_off, src_pitch, width, rows)


def copy_rows_for(kv_caches: Sequence[torch.Tensor]):
    """:func:`copy_rows` of the implementation that handles these KV tensors, resolved
    once (for callers that copy the same tensors many times)."""
    return implementation(kv_caches).copy_rows
