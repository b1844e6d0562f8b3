"""The CUDA-kernel path: same signatures and contracts as lmcache_cuda.reference.

Each call is one kernel launch covering every layer: the layers' base addresses sit
in a device int64 table (built once per set of layer tensors and cached).

Buffers off the KV device (pinned host memory) go through a device staging buffer
and one ``cudaMemcpyAsync`` (``Tensor.copy_(non_blocking=True)``) on the current
stream, rather than kernels writing host memory through mapped pointers: the copy
engine then moves the bytes over PCIe at full DMA speed without holding SMs for the
length of the transfer (the forward pass keeps them), gather/scatter on HBM costs a
few percent of the PCIe time, and correctness does not depend on how the pinned
memory was registered. The staging buffer comes from torch's caching allocator on the
current stream, so it is reused only after this stream's copy has run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache_cuda.dispatch import load_kernels
from lmcache_cuda.paged_layout import PagedLayout, PreparedLayers, check_index

_TABLE_CACHE_SIZE = 1024  # per-layer tables (layer-by-layer copies) plus whole-model ones


@dataclass(frozen=True)
class LayerTable:
    """Device int64 table of layer base addresses, and their common alignment."""

    ptrs: torch.Tensor
    align: int


_tables: "OrderedDict[tuple, LayerTable]" = OrderedDict()
_tables_lock = threading.Lock()


def layer_table(kv_caches: Sequence[torch.Tensor]) -> LayerTable:
    """The (cached) address table for these layer tensors.

    Built once per distinct set of addresses; the host-to-device copy is synchronized
    so that any stream may use the table afterwards (each use records its stream with
    the caching allocator).
    """
    addrs = tuple(t.data_ptr() for t in kv_caches)
    device = kv_caches[0].device
    key = (device, addrs)
    with _tables_lock:
        table = _tables.get(key)
        if table is not None:
            _tables.move_to_end(key)
            return table
    # A private stream, so that building the table never waits on queued compute work.
    private = torch.cuda.Stream(device)
    with torch.cuda.stream(private):
        ptrs = torch.tensor(addrs, dtype=torch.int64).to(device)
    private.synchronize()
    align = min(16, min(a & -a for a in addrs)) if all(addrs) else 1
    table = LayerTable(ptrs, align)
    with _tables_lock:
        _tables[key] = table
        while len(_tables) > _TABLE_CACHE_SIZE:
            _tables.popitem(last=False)
    return table


_layouts: "OrderedDict[tuple, PagedLayout]" = OrderedDict()


def _paged_layout(kv_caches: Sequence[torch.Tensor]) -> PagedLayout:
    """``PagedLayout.from_layers``, memoized on what it reads (every layer's address
    strides, shape and dtype, and the device): its checks cost about 50 us per call
    for a 32-layer model, paid on every copy otherwise."""
    first = kv_caches[0]
    key = (tuple((t.data_ptr(), t.stride(), t.shape, t.dtype) for t in kv_caches), first.device)
    layout = _layouts.get(key)
    if layout is None:
        layout = PagedLayout.from_layers(kv_caches)
        with _tables_lock:
            _layouts[key] = layout
            while len(_layouts) > _TABLE_CACHE_SIZE:
                _layouts.popitem(last=False)
    return layout


def _prepare(kv_caches: Sequence[torch.Tensor], index: torch.Tensor, what: str):
    prepared = kv_caches if isinstance(kv_caches, PreparedLayers) else None
    layout = prepared.layout if prepared is not None else _paged_layout(kv_caches)
    if layout.device.type != "cuda":
        raise ValueError(f"the CUDA kernels need CUDA KV tensors, got {layout.device}")
    check_index(index, what)
    if prepared is not None:
        if prepared.table is None:
            prepared.table = layer_table(prepared)
        table = prepared.table
    else:
        table = layer_table(kv_caches)
    stream = torch.cuda.current_stream(layout.device)
    table.ptrs.record_stream(stream)
    idx = index.to(layout.device, torch.int64).contiguous()
    return layout, table, idx


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_pinned()


def _staging_for(buf: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    if buf.device == layout.device:
        return buf
    return torch.empty(buf.shape, dtype=buf.dtype, device=layout.device)


def gather_tokens(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    layout, table, slots = _prepare(kv_caches, slot_mapping, "slot_mapping")
    layout.check_token_buffer(out, slots.numel(), "out")
    target = _staging_for(out, layout)
    load_kernels().gather_tokens(
        table.ptrs,
        table.align,
        slots,
        target,
        layout.element_size,
        layout.num_blocks,
        layout.num_kv_heads,
        layout.block_size,
        layout.head_size,
        layout.stride_block,
        layout.stride_head,
        layout.stride_token,
    )
    if target is not out:
        out.copy_(target, non_blocking=_pinned(out))
    return out


def scatter_tokens(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, src: torch.Tensor) -> None:
    layout, table, slots = _prepare(kv_caches, slot_mapping, "slot_mapping")
    layout.check_token_buffer(src, slots.numel(), "src")
    staged = src.to(layout.device, non_blocking=_pinned(src))
    load_kernels().scatter_tokens(
        table.ptrs,
        table.align,
        slots,
        staged,
        layout.element_size,
        layout.num_blocks,
        layout.num_kv_heads,
        layout.block_size,
        layout.head_size,
        layout.stride_block,
        layout.stride_head,
        layout.stride_token,
    )


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    layout, table, ids = _prepare(kv_caches, block_ids, "block_ids")
    layout.check_block_buffer(out, ids.numel(), "out")
    target = _staging_for(out, layout)
    load_kernels().gather_blocks(
        table.ptrs,
        table.align,
        ids,
        target,
        layout.element_size,
        layout.num_blocks,
        layout.block_numel,
        layout.stride_block,
    )
    if target is not out:
        out.copy_(target, non_blocking=_pinned(out))
    return out


def scatter_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, src: torch.Tensor) -> None:
    layout, table, ids = _prepare(kv_caches, block_ids, "block_ids")
    layout.check_block_buffer(src, ids.numel(), "src")
    staged = src.to(layout.device, non_blocking=_pinned(src))
    load_kernels().scatter_blocks(
        table.ptrs,
        table.align,
        ids,
        staged,
        layout.element_size,
        layout.num_blocks,
        layout.block_numel,
        layout.stride_block,
    )


def copy_segments(
    dsts: Sequence[torch.Tensor],
    dst_off: Sequence[int],
    srcs: Sequence[torch.Tensor],
    src_off: Sequence[int],
    nbytes: Sequence[int],
) -> None:
    """Byte-range copies (see reference.copy_segments), one native call: a
    ``cudaMemcpyAsync`` per segment on the current stream. The native side reports a
    bad segment as a message (raised here as ValueError), never by throwing."""
    err = load_kernels().copy_segments(list(dsts), list(dst_off), list(srcs), list(src_off), list(nbytes))
    if err:
        raise ValueError(err)
