"""Pure-torch reference implementations of the paged transfers.

Same signatures and contracts as the CUDA kernels (lmcache_cuda.kernels); used when
the kernels are unavailable, and as the oracle in the GPU tests. They run on CPU
and CUDA tensors. Copies go through integer views of the same element size, so they
are bit-exact for every dtype (fp8 included) and need no dtype-specific ops.

Contracts shared with the kernels:
- Token buffer: ``[num_layers, 2, num_tokens, num_kv_heads, head_size]``, contiguous,
  the KV dtype; K at ``[:, 0]``, V at ``[:, 1]``.
- Block buffer: ``[num_layers, n_blocks, ...]`` with ``block_numel`` elements per
  block, holding each block's elements in memory order.
- A buffer may live on the KV device or elsewhere (pinned host memory for
  asynchronous copies); copies are enqueued on the current stream.
- Slots outside ``[0, num_blocks * block_size)`` (vLLM pads with -1) and block ids
  outside ``[0, num_blocks)`` are skipped: gathers write zeros for them, scatters
  write nothing. Scatters with duplicate slots or ids leave an unspecified winner.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lmcache_cuda.paged_layout import PagedLayout, check_index, int_view, layout_of


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())


def gather_tokens(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy K and V of ``slot_mapping``'s tokens from every layer into ``out``."""
    layout = layout_of(kv_caches)
    check_index(slot_mapping, "slot_mapping")
    num_tokens = slot_mapping.numel()
    layout.check_token_buffer(out, num_tokens, "out")
    slots = slot_mapping.to(layout.device, torch.int64)
    valid = (slots >= 0) & (slots < layout.num_slots)
    safe = torch.where(valid, slots, 0)
    blk = safe // layout.block_size
    off = safe % layout.block_size
    same_device = out.device == layout.device
    target = int_view(out) if same_device else torch.empty(out.shape, dtype=int_view(out).dtype, device=layout.device)
    d = layout.head_size
    mask = valid.view(num_tokens, 1, 1)
    for layer, kv in enumerate(kv_caches):
        rows = int_view(kv).transpose(1, 2)[blk, off]  # [tokens, heads, 2 * head_size]
        rows = torch.where(mask, rows, 0)
        target[layer, 0].copy_(rows[..., :d])
        target[layer, 1].copy_(rows[..., d:])
    if not same_device:
        int_view(out).copy_(target, non_blocking=out.device.type == "cpu" and out.is_pinned())
    return out


def scatter_tokens(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, src: torch.Tensor) -> None:
    """Write K and V from ``src`` into every layer at ``slot_mapping``'s slots.

    Dropping invalid slots uses a boolean mask (one host sync on CUDA); the kernels
    have no such sync.
    """
    layout = layout_of(kv_caches)
    check_index(slot_mapping, "slot_mapping")
    layout.check_token_buffer(src, slot_mapping.numel(), "src")
    slots = slot_mapping.to(layout.device, torch.int64)
    valid = (slots >= 0) & (slots < layout.num_slots)
    src_i = _to_device(int_view(src), layout.device)
    keep = valid.nonzero().squeeze(1)
    slots = slots[keep]
    blk = slots // layout.block_size
    off = slots % layout.block_size
    for layer, kv in enumerate(kv_caches):
        rows = torch.cat([src_i[layer, 0], src_i[layer, 1]], dim=-1)[keep]
        int_view(kv).transpose(1, 2)[blk, off] = rows


def _flat_blocks(kv: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """``[num_blocks, block_numel]`` view of one layer, each row a block in memory order."""
    k = int_view(kv)
    return k.as_strided((layout.num_blocks, layout.block_numel), (layout.stride_block, 1), k.storage_offset())


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks ``block_ids`` of every layer into ``out`` ``[layers, n, ...]``."""
    layout = layout_of(kv_caches)
    check_index(block_ids, "block_ids")
    n = block_ids.numel()
    layout.check_block_buffer(out, n, "out")
    ids = block_ids.to(layout.device, torch.int64)
    valid = (ids >= 0) & (ids < layout.num_blocks)
    safe = torch.where(valid, ids, 0)
    same_device = out.device == layout.device
    out_i = int_view(out).view(layout.num_layers, n, layout.block_numel)
    target = out_i if same_device else torch.empty(out_i.shape, dtype=out_i.dtype, device=layout.device)
    for layer, kv in enumerate(kv_caches):
        rows = _flat_blocks(kv, layout)[safe]
        target[layer].copy_(torch.where(valid.view(n, 1), rows, 0))
    if not same_device:
        out_i.copy_(target, non_blocking=out.device.type == "cpu" and out.is_pinned())
    return out


def scatter_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write whole blocks from ``src`` ``[layers, n, ...]`` into ``block_ids`` of every layer."""
    layout = layout_of(kv_caches)
    check_index(block_ids, "block_ids")
    n = block_ids.numel()
    layout.check_block_buffer(src, n, "src")
    ids = block_ids.to(layout.device, torch.int64)
    keep = ((ids >= 0) & (ids < layout.num_blocks)).nonzero().squeeze(1)
    ids = ids[keep]
    src_i = _to_device(int_view(src).view(layout.num_layers, n, layout.block_numel), layout.device)
    for layer, kv in enumerate(kv_caches):
        _flat_blocks(kv, layout)[ids] = src_i[layer][keep]


def copy_segments(
    dsts: Sequence[torch.Tensor],
    dst_off: Sequence[int],
    srcs: Sequence[torch.Tensor],
    src_off: Sequence[int],
    nbytes: Sequence[int],
) -> None:
    """Segment ``i``: ``nbytes[i]`` bytes from contiguous ``srcs[i]`` at byte
    ``src_off[i]`` to contiguous ``dsts[i]`` at byte ``dst_off[i]``, enqueued on the
    current stream (asynchronous where pinned host memory is involved)."""
    n = len(nbytes)
    if not len(dsts) == len(dst_off) == len(srcs) == len(src_off) == n:
        raise ValueError(f"copy_segments: {len(dsts)} destinations, {len(srcs)} sources, {n} sizes")
    for i in range(n):
        d, s = dsts[i], srcs[i]
        if not (d.is_contiguous() and s.is_contiguous()):
            raise ValueError(f"copy_segments: segment {i} has a non-contiguous tensor")
        db, sb = d.view(-1).view(torch.uint8), s.view(-1).view(torch.uint8)
        k, a, b = nbytes[i], dst_off[i], src_off[i]
        if min(k, a, b) < 0 or a + k > db.numel() or b + k > sb.numel():
            raise ValueError(f"copy_segments: segment {i} ({k} bytes at {b} -> {a}) is outside its tensors")
        if k:
            pinned = (s.device.type == "cpu" and s.is_pinned()) or (d.device.type == "cpu" and d.is_pinned())
            db[a : a + k].copy_(sb[b : b + k], non_blocking=pinned)


class LayerCopies:
    """The reference for :class:`lmcache_cuda.kernels.LayerCopies`: one layer per call."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], index: torch.Tensor, granularity: str) -> None:
        if granularity not in ("tokens", "blocks"):
            raise ValueError(f"granularity={granularity!r}: use 'tokens' or 'blocks'")
        layout = layout_of(kv_caches)
        check_index(index, "slot_mapping" if granularity == "tokens" else "block_ids")
        self.num_layers = layout.num_layers
        self._layers = list(kv_caches)
        self._index = index
        self._fns = (gather_tokens, scatter_tokens) if granularity == "tokens" else (gather_blocks, scatter_blocks)

    def run(self, layer: int, buf: torch.Tensor, gather: bool) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        self._fns[0 if gather else 1]([self._layers[layer]], self._index, buf)

    def bind(self, layer: int, buf: torch.Tensor, gather: bool):
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return lambda: self.run(layer, buf, gather)

    def run_all(self, buf: torch.Tensor, gather: bool) -> None:
        self._fns[0 if gather else 1](self._layers, self._index, buf)


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
    """:func:`copy_segments` with ``rows[i]`` rows of ``width[i]`` bytes per segment,
    row ``r`` at ``dst_off[i] + r * dst_pitch[i]`` (and likewise in the source)."""
    n = len(width)
    if not len(dsts) == len(dst_off) == len(dst_pitch) == len(srcs) == len(src_off) == len(src_pitch) == len(rows) == n:
        raise ValueError("copy_rows: lists of different lengths")
    seg: tuple[list, list, list, list, list] = ([], [], [], [], [])
    for i in range(n):
        if rows[i] < 0 or width[i] < 0 or (rows[i] > 1 and (dst_pitch[i] < width[i] or src_pitch[i] < width[i])):
            raise ValueError(f"copy_rows: segment {i} has rows wider than their pitch")
        for r in range(rows[i]):
            for lst, v in zip(seg, (dsts[i], dst_off[i] + r * dst_pitch[i], srcs[i], src_off[i] + r * src_pitch[i], width[i])):
                lst.append(v)
    copy_segments(*seg)
