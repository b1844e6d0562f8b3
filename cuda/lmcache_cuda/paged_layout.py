"""The paged KV layout the transfers read and write, validated once.

vLLM 0.32 hands connectors one tensor per layer with the logical shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K is the first
``head_size`` of the last dim, V the second). The physical order of the first three
dims may differ (a permuted view), so the layout keeps the element strides and both
the kernels and the reference follow them; only the last dim must be dense.

Slot ``s`` names token offset ``s % block_size`` in block ``s // block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as the integer dtype of its element size (bit-exact copies)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


@dataclass(frozen=True)
class PagedLayout:
    """Shape, dtype, device and element strides shared by every layer's KV tensor."""

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype
    device: torch.device
    stride_block: int
    stride_head: int
    stride_token: int

    @classmethod
    def from_layers(cls, kv_caches: Sequence[torch.Tensor]) -> "PagedLayout":
        """Validate that all layers share one paged layout and describe it."""
        if len(kv_caches) == 0:
            raise ValueError("kv_caches is empty: pass one paged KV tensor per layer")
        first = kv_caches[0]
        if first.dim() != 4:
            raise ValueError(
                f"layer 0 has shape {tuple(first.shape)}; expected vLLM 0.32's "
                "[num_blocks, num_kv_heads, block_size, 2 * head_size]"
            )
        if first.shape[3] % 2 != 0:
            raise ValueError(f"layer 0: last dim {first.shape[3]} is not 2 * head_size")
        if first.stride(3) != 1:
            raise ValueError(f"layer 0: last dim must be dense (stride 1), got strides {first.stride()}")
        if _INT_OF_SIZE.get(first.element_size()) is None:
            raise ValueError(f"layer 0: unsupported dtype {first.dtype}")
        for i, t in enumerate(kv_caches[1:], start=1):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; layer 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}"
                )
            if t.stride() != first.stride():
                raise ValueError(f"layer {i} has strides {t.stride()}, layer 0 has {first.stride()}")
        nb, h, b, two_d = first.shape
        return cls(
            num_layers=len(kv_caches),
            num_blocks=nb,
            num_kv_heads=h,
            block_size=b,
            head_size=two_d // 2,
            dtype=first.dtype,
            device=first.device,
            stride_block=first.stride(0),
            stride_head=first.stride(1),
            stride_token=first.stride(2),
        )

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_numel(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def blocks_are_dense(self) -> bool:
        """True when each block is one dense region of ``block_numel`` elements.

        Block copies move a block's bytes in memory order, so they need this; token
        copies do not.
        """
        dims = sorted([(self.stride_token, self.block_size), (self.stride_head, self.num_kv_heads)])
        expected = 2 * self.head_size
        for stride, size in dims:
            if size != 1 and stride != expected:
                return False
            expected *= size
        return self.num_blocks == 1 or self.stride_block >= self.block_numel

    def token_buffer_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_size)

    def check_token_buffer(self, buf: torch.Tensor, num_tokens: int, what: str) -> None:
        want = self.token_buffer_shape(num_tokens)
        if tuple(buf.shape) != want:
            raise ValueError(
                f"{what} has shape {tuple(buf.shape)}; expected [layers, 2, tokens, kv_heads, head_size] = {list(want)}"
            )
        self._check_buffer(buf, what)

    def check_block_buffer(self, buf: torch.Tensor, num_ids: int, what: str) -> None:
        if not self.blocks_are_dense():
            raise ValueError(
                "block copies need each block to be one dense region; this layout has "
                f"strides block={self.stride_block} head={self.stride_head} "
                f"token={self.stride_token}: use the token copies instead"
            )
        want = self.num_layers * num_ids * self.block_numel
        if buf.numel() != want or buf.dim() < 2 or buf.shape[:2] != (self.num_layers, num_ids):
            raise ValueError(
                f"{what} has shape {tuple(buf.shape)}; expected [layers, n_blocks, ...] "
                f"with {self.num_layers} x {num_ids} x {self.block_numel} elements"
            )
        self._check_buffer(buf, what)

    def _check_buffer(self, buf: torch.Tensor, what: str) -> None:
        if buf.dtype != self.dtype:
            raise ValueError(f"{what} is {buf.dtype}; the KV cache is {self.dtype}")
        if not buf.is_contiguous():
            raise ValueError(f"{what} must be contiguous")


class PreparedLayers(tuple):
    """Layer tensors validated once: a tuple of the tensors (usable wherever a list of
    layers is) that carries its :class:`PagedLayout` and, once a kernel has run on it,
    its device address table. For callers that copy the same layers many times (the
    connector's adapters): each call then skips the checks and the address lookup,
    which cost more than a small copy. The tensors must not be resized or moved."""

    layout: PagedLayout
    table: Any  # kernels.LayerTable once a kernel has run on these layers, else None
    layer_rows: Any  # (table, its one-layer views) once a layer-by-layer copy has run, else None

    def __new__(cls, kv_caches: Sequence[torch.Tensor]) -> "PreparedLayers":
        self = super().__new__(cls, kv_caches)
        self.layout = PagedLayout.from_layers(self)
        self.table = None  # kernels.LayerTable, set on first use
        self.layer_rows = None
        return self


def layout_of(kv_caches: Sequence[torch.Tensor]) -> PagedLayout:
    """The layout of ``kv_caches``: prepared once, or validated now."""
    if isinstance(kv_caches, PreparedLayers):
        return kv_caches.layout
    return PagedLayout.from_layers(kv_caches)


def check_index(index: torch.Tensor, what: str) -> None:
    """Slot mappings and block ids: 1-D integer tensors on any device."""
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what} must be a 1-D int32/int64 tensor, got {index.dtype} {tuple(index.shape)}")
