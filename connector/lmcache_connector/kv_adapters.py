"""Layout adapters: move KV between vLLM's paged per-layer tensors and chunk buffers.

vLLM 0.32 hands connectors one tensor per layer, logically
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.

* :class:`BlockLayout` copies whole blocks as opaque data: chunk buffer
  ``[num_layers, n_blocks, *block_shape]``. Correct for every attention backend,
  including vLLM's CPU backend whose in-block layout is ISA-dependent (K stored
  transposed), because it never looks inside a block. Its fingerprint therefore
  includes the CPU's ISA: blocks written on an AVX-512 machine are not readable on
  an AVX2 one.
* :class:`TokenLayout` gathers per-token K and V through the slot mapping into the
  canonical ``[num_layers, 2, n_tokens, num_kv_heads, head_size]``: portable across
  block sizes, valid only where the logical shape is the physical one (GPU
  FlashAttention layouts). Refused on CPU.

The fingerprint goes into the key namespace, so caches written with another adapter,
shape, dtype or block size miss instead of loading garbage.
"""

from __future__ import annotations

import platform
from typing import Any, Sequence

import torch


class LayoutError(ValueError):
    """The paged KV tensors cannot be handled by the chosen adapter."""


def _check_layers(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    if not kv_caches:
        raise LayoutError("no KV cache tensors were registered")
    layers = list(kv_caches.values())
    first = layers[0]
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(
                f"layer {name} has KV {t.dtype}{list(t.shape)} on {t.device}, the first layer "
                f"{first.dtype}{list(first.shape)} on {first.device}: mixed layouts are not supported"
            )
        if t.dim() != 4:
            raise LayoutError(f"layer {name}: expected a 4-d paged KV tensor, got shape {list(t.shape)}")
    return layers


def _cuda_ops(device: torch.device) -> Any:
    """``lmcache_cuda.ops`` for CUDA tensors when that optional package is installed
    (it picks its kernels or its own torch reference and says which); else ``None``
    and the pure-torch code below runs."""
    if device.type != "cuda":
        return None
    try:
        import lmcache_cuda.ops as ops
    except ImportError:
        return None
    return ops


def transfer_path(device: torch.device) -> str:
    """Which code moves KV: for the start-up log line."""
    if _cuda_ops(device) is None:
        return "torch"
    import lmcache_cuda

    return f"lmcache_cuda:{lmcache_cuda.backend_name()} ({lmcache_cuda.backend_reason()})"


def isa_tag(device: torch.device) -> str:
    if device.type == "cpu":
        return f"cpu-{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"
    return device.type


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """``block_ids`` as runs of consecutive ids, ``(position, first id, count)``, when
    there are few enough runs that slice copies beat one indexed copy (a slice copy
    is a plain memcpy: about twice the speed of ``index_copy_`` on CPU); else None."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            p, first, count = runs[-1]
            runs[-1] = (p, first, count + 1)
        else:
            runs.append((pos, b, 1))
    return runs if runs and 2 * len(runs) <= len(block_ids) + 1 else None


class _PagedLayers:
    """What both adapters know of vLLM's per-layer KV tensors."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        self.layers = _check_layers(kv_caches)
        self.block_size = block_size
        first = self.layers[0]
        self.dtype = first.dtype
        self.device = first.device
        self.num_layers = len(self.layers)
        self._ops = _cuda_ops(self.device)


class BlockLayout(_PagedLayers):
    kind = "block"

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        super().__init__(kv_caches, block_size)
        self.block_shape = tuple(self.layers[0].shape[1:])

    def fingerprint(self) -> str:
        return (
            f"block/v1/{isa_tag(self.device)}/{str(self.dtype).removeprefix('torch.')}/"
            f"L{self.num_layers}/bs{self.block_size}/{'x'.join(map(str, self.block_shape))}"
        )

    def chunk_shape(self, n_tokens: int) -> tuple[int, ...]:
        n_blocks = -(-n_tokens // self.block_size)
        return (self.num_layers, n_blocks, *self.block_shape)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out[:, :len(block_ids)]``."""
        n = len(block_ids)
        runs = block_runs(block_ids) if self._ops is None else None
        if runs is not None:
            for layer, kv in enumerate(self.layers):
                for pos, first, count in runs:
                    out[layer, pos : pos + count].copy_(kv[first : first + count], non_blocking=True)
            return
        idx = self._index(block_ids)
        if self._ops is not None:
            self._ops.gather_blocks(self.layers, idx, out[:, :n])
            return
        for layer, kv in enumerate(self.layers):
            if kv.device == out.device:
                torch.index_select(kv, 0, idx, out=out[layer, :n])
            else:
                out[layer, :n].copy_(kv.index_select(0, idx), non_blocking=True)

    def save_chunk(self, block_ids: Sequence[int], lo: int, hi: int, out: torch.Tensor) -> None:
        """Gather the blocks holding tokens ``lo..hi`` of a request into ``out``."""
        bs = self.block_size
        self.gather(block_ids[lo // bs : -(-hi // bs)], out)

    def load_chunk(self, buf: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, write_from: int) -> None:
        """Write chunk ``buf`` (tokens ``lo..hi``) into the request's blocks, skipping
        blocks before token ``write_from`` (vLLM's own prefix-cache blocks, which may be
        shared with other requests and must never be written)."""
        bs = self.block_size
        first_block = max(lo, write_from) // bs
        last_block = min(-(-hi // bs), len(block_ids))
        if last_block > first_block:
            self.scatter(buf, block_ids[first_block:last_block], first=first_block - lo // bs)

    def scatter(self, buf: torch.Tensor, block_ids: Sequence[int], first: int = 0) -> None:
        """Write ``buf[:, first:first+len(block_ids)]`` into blocks ``block_ids``."""
        n = len(block_ids)
        runs = block_runs(block_ids) if self._ops is None else None
        if runs is not None:
            for layer, kv in enumerate(self.layers):
                for pos, start, count in runs:
                    kv[start : start + count].copy_(buf[layer, first + pos : first + pos + count], non_blocking=True)
            return
        idx = self._index(block_ids)
        if self._ops is not None:
            self._ops.scatter_blocks(self.layers, idx, buf[:, first : first + n].contiguous())
            return
        for layer, kv in enumerate(self.layers):
            src = buf[layer, first : first + n]
            if src.device != kv.device:
                src = src.to(kv.device, non_blocking=True)
            kv.index_copy_(0, idx, src)


class TokenLayout(_PagedLayers):
    kind = "token"

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int, *, allow_cpu: bool = False) -> None:
        """``allow_cpu`` is for tensors that really are in the logical layout (tests of
        the pure-torch path); vLLM's CPU backend tensors are not."""
        super().__init__(kv_caches, block_size)
        if self.device.type == "cpu" and not allow_cpu:
            raise LayoutError(
                "layout: token needs a KV layout whose logical shape is physical (GPU FlashAttention); "
                "vLLM's CPU backend stores blocks in an ISA-dependent layout: use layout: block"
            )
        nb, heads, bs, two_d = self.layers[0].shape
        if bs != block_size or two_d % 2:
            raise LayoutError(f"unexpected KV shape {list(self.layers[0].shape)} for block size {block_size}")
        self.num_heads = heads
        self.head_size = two_d // 2

    def fingerprint(self) -> str:
        # Block size is deliberately absent: token chunks are portable across it.
        return f"token/v1/{str(self.dtype).removeprefix('torch.')}/L{self.num_layers}/h{self.num_heads}/d{self.head_size}"

    def chunk_shape(self, n_tokens: int) -> tuple[int, ...]:
        return (self.num_layers, 2, n_tokens, self.num_heads, self.head_size)

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block index, offset) of token positions ``start..end`` of a request."""
        pos = torch.arange(start, end, device=self.device)
        table = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return table[pos // self.block_size], pos % self.block_size

    def save_chunk(self, block_ids: Sequence[int], lo: int, hi: int, out: torch.Tensor) -> None:
        self.gather_tokens(block_ids, lo, hi, out)

    def load_chunk(self, buf: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, write_from: int) -> None:
        start = max(lo, write_from)
        if hi > start:
            self.scatter_tokens(buf, block_ids, start, hi, first=start - lo)

    def gather_tokens(self, block_ids: Sequence[int], start: int, end: int, out: torch.Tensor) -> None:
        blk, off = self.slots(block_ids, start, end)
        if self._ops is not None:
            self._ops.gather_tokens(self.layers, blk * self.block_size + off, out[:, :, : end - start])
            return
        d = self.head_size
        for layer, kv in enumerate(self.layers):
            per_tok = kv.transpose(1, 2)[blk, off]  # [T, H, 2D]
            out[layer, 0, : end - start].copy_(per_tok[..., :d], non_blocking=True)
            out[layer, 1, : end - start].copy_(per_tok[..., d:], non_blocking=True)

    def scatter_tokens(self, buf: torch.Tensor, block_ids: Sequence[int], start: int, end: int, first: int = 0) -> None:
        blk, off = self.slots(block_ids, start, end)
        n = end - start
        if self._ops is not None:
            self._ops.scatter_tokens(self.layers, blk * self.block_size + off, buf[:, :, first : first + n].contiguous())
            return
        for layer, kv in enumerate(self.layers):
            k = buf[layer, 0, first : first + n].to(kv.device, non_blocking=True)
            v = buf[layer, 1, first : first + n].to(kv.device, non_blocking=True)
            kv.transpose(1, 2)[blk, off] = torch.cat([k, v], dim=-1)


def make_layout(kind: str, kv_caches: dict[str, torch.Tensor], block_size: int) -> BlockLayout | TokenLayout:
    """``auto`` picks token on GPUs and block elsewhere."""
    if kind == "auto":
        first = next(iter(kv_caches.values()), None)
        kind = "token" if first is not None and first.device.type == "cuda" else "block"
    if kind == "block":
        return BlockLayout(kv_caches, block_size)
    if kind == "token":
        return TokenLayout(kv_caches, block_size)
    raise LayoutError(f"layout: unknown adapter {kind!r} (block, token or auto)")
