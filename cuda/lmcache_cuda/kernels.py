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

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

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


def table_of(kv_caches: Sequence[torch.Tensor]) -> LayerTable:
    """The address table of these layers: kept on prepared layers (built at first use),
    else looked up in the cache of :func:`layer_table`."""
    if isinstance(kv_caches, PreparedLayers):
        if kv_caches.table is None:
            kv_caches.table = layer_table(kv_caches)
        return kv_caches.table
    return layer_table(kv_caches)


def _prepare(kv_caches: Sequence[torch.Tensor], index: torch.Tensor, what: str):
    prepared = kv_caches if isinstance(kv_caches, PreparedLayers) else None
    layout = prepared.layout if prepared is not None else _paged_layout(kv_caches)
    if layout.device.type != "cuda":
        raise ValueError(f"the CUDA kernels need CUDA KV tensors, got {layout.device}")
    check_index(index, what)
    table = table_of(kv_caches)
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


def _layer_rows(kv_caches: Sequence[torch.Tensor], table: LayerTable) -> list[torch.Tensor]:
    """One-layer views of ``table`` (kept on prepared layers: built once, not per step)."""
    cached = getattr(kv_caches, "layer_rows", None)
    if cached is not None and cached[0] is table:
        return cached[1]
    rows = [table.ptrs[i : i + 1] for i in range(table.ptrs.numel())]
    if isinstance(kv_caches, PreparedLayers):
        kv_caches.layer_rows = (table, rows)
    return rows


class LayerCopies:
    """One index (slots or block ids) against each layer of ``kv_caches``, checked once:
    :meth:`run` is then one kernel launch for one layer, between that layer and a
    device buffer (``[1, 2, tokens, heads, head_size]`` or ``[1, n_blocks, ...]``).
    For callers that copy a step layer by layer (the connector's layer pipeline),
    where the checks and the dispatch of a full call cost more host time than the
    copy takes on the GPU. The caller keeps ``index`` and the buffers alive until the
    copies have run."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], index: torch.Tensor, granularity: str) -> None:
        tokens = granularity == "tokens"
        if not tokens and granularity != "blocks":
            raise ValueError(f"granularity={granularity!r}: use 'tokens' or 'blocks'")
        layout, table, idx = _prepare(kv_caches, index, "slot_mapping" if tokens else "block_ids")
        if not tokens and not layout.blocks_are_dense():
            raise ValueError("block copies need each block to be one dense region: use the token copies instead")
        self.num_layers = layout.num_layers
        self._rows = _layer_rows(kv_caches, table)
        self._all = table.ptrs
        self._align = table.align
        self._idx = idx
        self._dtype = layout.dtype
        self._device = layout.device
        k = load_kernels()
        if tokens:
            self._numel = 2 * idx.numel() * layout.num_kv_heads * layout.head_size
            self._fns = (k.gather_tokens, k.scatter_tokens)
            self._args: tuple = (
                layout.element_size,
                layout.num_blocks,
                layout.num_kv_heads,
                layout.block_size,
                layout.head_size,
                layout.stride_block,
                layout.stride_head,
                layout.stride_token,
            )
        else:
            self._numel = idx.numel() * layout.block_numel
            self._fns = (k.gather_blocks, k.scatter_blocks)
            self._args = (layout.element_size, layout.num_blocks, layout.block_numel, layout.stride_block)

    def run(self, layer: int, buf: torch.Tensor, gather: bool) -> None:
        """Gather layer ``layer`` into ``buf`` (or scatter ``buf`` into it) on the current stream."""
        self._check(layer, buf)
        self._fns[0 if gather else 1](self._rows[layer], self._align, self._idx, buf, *self._args)

    def _check(self, layer: int, buf: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        # The native side checks these too, but by throwing, which was seen to crash
        # the process: a wrong buffer is refused here instead.
        if buf.device != self._device or buf.dtype != self._dtype or buf.numel() != self._numel or not buf.is_contiguous():
            raise ValueError(
                f"buffer {buf.dtype}{tuple(buf.shape)} on {buf.device}: expected {self._numel} contiguous "
                f"{self._dtype} elements on {self._device}"
            )

    def bind(self, layer: int, buf: torch.Tensor, gather: bool) -> Callable[[], None]:
        """``run(layer, buf, gather)`` checked now: a call of the result is the launch alone."""
        self._check(layer, buf)
        return functools.partial(self._fns[0 if gather else 1], self._rows[layer], self._align, self._idx, buf, *self._args)

    def run_all(self, buf: torch.Tensor, gather: bool) -> None:
        """Every layer in one launch, ``buf`` ``[layers, ...]``."""
        if (
            buf.device != self._device
            or buf.dtype != self._dtype
            or buf.numel() != self._numel * self.num_layers
            or not buf.is_contiguous()
        ):
            raise ValueError(
                f"buffer {buf.dtype}{tuple(buf.shape)} on {buf.device}: expected {self._numel * self.num_layers} "
                f"contiguous {self._dtype} elements on {self._device}"
            )
        self._fns[0 if gather else 1](self._all, self._align, self._idx, buf, *self._args)


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
    """2-D byte-range copies (see reference.copy_rows), one native call: a
    ``cudaMemcpy2DAsync`` per segment (``cudaMemcpyAsync`` for one row) on the current
    stream; a bad segment is reported as ValueError."""
    err = load_kernels().copy_rows(
        list(dsts), list(dst_off), list(dst_pitch), list(srcs), list(src_off), list(src_pitch), list(width), list(rows)
    )
    if err:
        raise ValueError(err)
