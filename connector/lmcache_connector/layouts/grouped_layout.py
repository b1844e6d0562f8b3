"""Layout adapter for models with several KV-cache groups (vLLM's hybrid KV cache
manager): sliding-window and full attention, attention plus Mamba / gated delta-net.

Every layer's cache is seen as pages of raw bytes, one page per engine block
(``[num_blocks, page_bytes]`` uint8 over vLLM's own memory, whatever the layer's
dtype or state shapes), and whole pages are copied: like :class:`BlockLayout` it never
looks inside a block, so the CPU backend's ISA-dependent block interior and the
mamba conv/SSM state packing are carried as they are.

Two kinds of objects (see :mod:`lmcache_connector.layouts.groups`):

* chunk object: the pages of the full-attention layers for the chunk's blocks,
  ``[n_full_layers * n_blocks * page_bytes]``;
* boundary object at token ``E``: the sliding-window layers' pages covering the
  window before ``E``, then each state layer's page at the slot of ``E`` (its real,
  unpadded bytes).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from .groups import FULL, STATE, WINDOW, GroupPlan
from .kv_adapters import LayoutError, isa_tag

NULL_BLOCK = 0  # vLLM's null block (a placeholder in freed or skipped table slots)


def page_view(kv: Any, page_bytes: int, ratio: int = 1) -> torch.Tensor:
    """``[num_blocks, page_bytes]`` uint8 view of a layer's cache (a tensor, or the
    list of state tensors a mamba layer has, all views of one page per block).

    ``ratio``: kernel blocks per page, where the attention kernels' block is a fraction
    of vLLM's (hybrid models on GPU); vLLM allows that only for dense, unpadded pages,
    so a page is then ``ratio`` consecutive kernel blocks."""
    first = kv if isinstance(kv, torch.Tensor) else kv[0]
    item = first.element_size()
    stride, offset, nb = first.stride(0) * item, first.storage_offset() * item, first.shape[0]
    if ratio > 1:
        if stride * ratio != page_bytes or nb % ratio:
            raise LayoutError(
                f"KV tensor {first.dtype}{list(first.shape)} (block stride {stride} B): {ratio} kernel blocks "
                f"do not make one dense page of {page_bytes} B"
            )
        nb, stride = nb // ratio, page_bytes
    storage = first.untyped_storage()
    if stride < page_bytes or offset + (nb - 1) * stride + page_bytes > storage.nbytes():
        raise LayoutError(
            f"KV tensor {first.dtype}{list(first.shape)} (block stride {stride} B) does not hold {nb} pages of {page_bytes} B"
        )
    base = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return base.as_strided((nb, page_bytes), (stride, 1), offset)


def _kernel_ratio(kv: Any, g: Any) -> int:
    """Kernel blocks per vLLM block for an attention layer ``[B, H, N, C]`` whose
    kernels use blocks of N < the group's block size (1 otherwise, and for states)."""
    if g.kind == STATE or not isinstance(kv, torch.Tensor) or kv.dim() != 4:
        return 1
    n = int(kv.shape[2])
    return g.block_size // n if 0 < n < g.block_size and g.block_size % n == 0 else 1


def _on(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    return src if src.device == device else src.to(device, non_blocking=src.device.type == "cpu" and src.is_pinned())


def _describe(kv: Any) -> str:
    ts = [kv] if isinstance(kv, torch.Tensor) else list(kv)
    return "+".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape[1:])}" for t in ts)


class GroupedLayout:
    kind = "grouped"
    dtype = torch.uint8

    def __init__(
        self,
        kv_caches: dict[str, Any],
        plan: GroupPlan,
        page_bytes: dict[int, int],
        real_bytes: dict[int, int],
    ) -> None:
        """``page_bytes[g]`` / ``real_bytes[g]``: group g's page size in vLLM's pool and
        the bytes of it that hold data (they differ for padded state pages)."""
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered")
        self.plan = plan
        self.views: dict[str, torch.Tensor] = {}
        shapes = []
        for g in plan.groups:
            for name in g.layer_names:
                if name not in kv_caches:
                    raise LayoutError(f"layer {name} of KV-cache group {g.index} was not registered by vLLM")
                self.views[name] = page_view(kv_caches[name], page_bytes[g.index], _kernel_ratio(kv_caches[name], g))
                shapes.append(f"{name}={_describe(kv_caches[name])}")
        first = next(iter(self.views.values()))
        self.device = first.device
        self.page_bytes = page_bytes
        self.real_bytes = real_bytes
        self.full = [(g, self.views[n]) for g in plan.of_kind(FULL) for n in g.layer_names]
        self.window = [(g, self.views[n]) for g in plan.of_kind(WINDOW) for n in g.layer_names]
        self.state = [(g, self.views[n]) for g in plan.of_kind(STATE) for n in g.layer_names]
        self._shape_digest = hashlib.blake2b(";".join(shapes).encode(), digest_size=8).hexdigest()
        self.num_layers = len(self.views)

    def fingerprint(self) -> str:
        return f"grouped/v1/{isa_tag(self.device)}/{self.plan.fingerprint()}/{self._shape_digest}"

    # -- chunk objects: full-attention pages -----------------------------------------
    def _bs(self) -> int:
        return self.plan.token_block_size()

    def chunk_shape(self, n_tokens: int) -> tuple[int, ...]:
        n_blocks = -(-n_tokens // self._bs())
        return (sum(self.page_bytes[g.index] for g, _ in self.full) * n_blocks,)

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def save_chunk(self, block_ids: Sequence[Sequence[int]], lo: int, hi: int, out: torch.Tensor) -> None:
        off = 0
        for g, view in self.full:
            bs, pb = g.block_size, self.page_bytes[g.index]
            ids = block_ids[g.index][lo // bs : -(-hi // bs)]
            n = len(ids)
            out[off : off + n * pb].view(n, pb).copy_(view.index_select(0, self._index(ids)))
            off += n * pb

    def load_chunk(self, buf: torch.Tensor, block_ids: Sequence[Sequence[int]], lo: int, hi: int, write_from: int) -> None:
        """Write the chunk's full-attention pages, never into blocks before token
        ``write_from`` (vLLM's own prefix-cache blocks, possibly shared)."""
        off = 0
        for g, view in self.full:
            bs, pb = g.block_size, self.page_bytes[g.index]
            first, last = lo // bs, -(-hi // bs)
            n = last - first
            start = max(first, max(lo, write_from) // bs)
            ids = block_ids[g.index][start:last]
            if ids:
                src = buf[off : off + n * pb].view(n, pb)[start - first : start - first + len(ids)]
                view.index_copy_(0, self._index(ids), _on(src, view.device))
            off += n * pb
        self.finish()

    def finish(self) -> None:
        """Wait for the copies enqueued on the current CUDA stream (no-op on CPU), so
        the host buffers they read or write may be stored or reused."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- boundary objects: window pages and states -----------------------------------
    def boundary_shape(self, end: int) -> tuple[int, ...]:
        n = sum(len(g.window_blocks(end)) * self.page_bytes[g.index] for g, _ in self.window)
        n += sum(self.real_bytes[g.index] for g, _ in self.state)
        return (n,)

    def save_boundary(self, block_ids: Sequence[Sequence[int]], end: int, out: torch.Tensor) -> bool:
        """Gather the boundary at token ``end``; False (nothing usable) when a page it
        needs is no longer the request's (a freed window block, no state slot)."""
        plan: list[tuple[torch.Tensor, list[int], int, int]] = []
        for g, view in self.window:
            table = block_ids[g.index]
            rng = g.window_blocks(end)
            if rng.stop > len(table):
                return False
            ids = [table[i] for i in rng]
            if NULL_BLOCK in ids:
                return False
            plan.append((view, ids, self.page_bytes[g.index], 0))
        for g, view in self.state:
            table = block_ids[g.index]
            slot = g.state_slot(end)
            if slot >= len(table) or table[slot] == NULL_BLOCK:
                return False
            plan.append((view, [table[slot]], self.page_bytes[g.index], self.real_bytes[g.index]))
        off = 0
        for view, ids, pb, real in plan:
            if real:  # one state page, its data bytes only
                out[off : off + real].copy_(view[ids[0], :real])
                off += real
            else:
                n = len(ids)
                out[off : off + n * pb].view(n, pb).copy_(view.index_select(0, self._index(ids)))
                off += n * pb
        return True

    def load_boundary(self, buf: torch.Tensor, block_ids: Sequence[Sequence[int]], end: int, write_from: int) -> None:
        """Write a boundary object into the blocks vLLM allocated for a hit ending at
        ``end`` (or one token short of it): window pages into the non-null blocks at or
        after ``write_from``, states into their slot."""
        off = 0
        for g, view in self.window:
            pb = self.page_bytes[g.index]
            table = block_ids[g.index]
            rng = g.window_blocks(end)
            floor = write_from // g.block_size
            pairs = [(j, table[i]) for j, i in enumerate(rng) if i >= floor and i < len(table) and table[i] != NULL_BLOCK]
            if pairs:
                src = _on(buf[off : off + len(rng) * pb].view(len(rng), pb), view.device)
                rows = self._index([j for j, _ in pairs])
                view.index_copy_(0, self._index([b for _, b in pairs]), src.index_select(0, rows))
            off += len(rng) * pb
        for g, view in self.state:
            real = self.real_bytes[g.index]
            table = block_ids[g.index]
            slot = g.state_slot(end)
            if slot >= len(table) or table[slot] == NULL_BLOCK:
                raise LayoutError(f"group {g.index}: no state block at slot {slot} for a hit of {end} tokens")
            view[table[slot], :real].copy_(buf[off : off + real], non_blocking=True)
            off += real
        self.finish()
