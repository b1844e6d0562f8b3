"""Helpers for the transfer tests (CPU and GPU) and the benchmark: random paged caches,
ragged slot mappings, and expectations written straight from vLLM's layout definition
(``kv.transpose(1, 2).split(head_size, -1)``), independent of lmcache_cuda.reference."""

from __future__ import annotations

from typing import Sequence

import torch

from lmcache_cuda.paged_layout import int_view

DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8_as_uint8": torch.uint8,
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn


def random_paged_kv(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    permuted: bool = False,
    seed: int = 0,
) -> list[torch.Tensor]:
    """One random tensor per layer, logical shape [blocks, heads, block_size, 2 * head_size].

    Random bytes, so every bit pattern (NaNs included) must survive a copy. With
    ``permuted`` the memory order is [blocks, block_size, heads, 2 * head_size] (the
    tensor is a transposed view), as a GPU attention backend may allocate it.
    """
    g = torch.Generator().manual_seed(seed)
    es = torch.empty((), dtype=dtype).element_size()
    layers = []
    for _ in range(num_layers):
        phys = (num_blocks, block_size, num_kv_heads) if permuted else (num_blocks, num_kv_heads, block_size)
        raw = torch.randint(0, 256, (*phys, 2 * head_size * es), dtype=torch.uint8, generator=g)
        t = raw.view(dtype).to(device)
        layers.append(t.transpose(1, 2) if permuted else t)
    return layers


def ragged_slots(num_blocks: int, block_size: int, num_tokens: int, *, pad: int = 0, seed: int = 0) -> torch.Tensor:
    """Unique slots over shuffled, non-contiguous blocks, the last block partly used,
    followed by ``pad`` entries of -1 (vLLM's padding)."""
    g = torch.Generator().manual_seed(seed)
    needed = -(-num_tokens // block_size)
    if needed > num_blocks:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks, have {num_blocks}")
    blocks = torch.randperm(num_blocks, generator=g)[:needed]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:num_tokens]
    return torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64)])


def expected_gather(kv_caches: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """[layers, 2, tokens, heads, head_size] (integer view), token by token."""
    num_blocks, heads, block_size, two_d = kv_caches[0].shape
    d = two_d // 2
    out = torch.zeros((len(kv_caches), 2, slots.numel(), heads, d), dtype=int_view(kv_caches[0]).dtype)
    for layer, kv in enumerate(kv_caches):
        k, v = int_view(kv).cpu().transpose(1, 2).split(d, -1)
        for t, s in enumerate(slots.tolist()):
            if 0 <= s < num_blocks * block_size:
                out[layer, 0, t] = k[s // block_size, s % block_size]
                out[layer, 1, t] = v[s // block_size, s % block_size]
    return out


def expected_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """[layers, n, block_numel] (integer view): each block's elements in memory order."""
    num_blocks = kv_caches[0].shape[0]
    numel = kv_caches[0][0].numel()
    out = torch.zeros((len(kv_caches), block_ids.numel(), numel), dtype=int_view(kv_caches[0]).dtype)
    for layer, kv in enumerate(kv_caches):
        k = int_view(kv).cpu()
        # Memory order of one block: sort its dims by stride, largest first.
        order = sorted(range(1, 4), key=lambda i: k.stride()[i], reverse=True)
        for n, b in enumerate(block_ids.tolist()):
            if 0 <= b < num_blocks:
                out[layer, n] = k[b].permute([i - 1 for i in order]).reshape(-1)
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included), across devices."""
    return a.shape == b.shape and torch.equal(int_view(a).cpu(), int_view(b).cpu())


# vLLM 0.32's KVCacheLayout members: the stride permutation from the logical
# [L, B, H, N, C] (layers, blocks, heads, tokens in a block, content) to memory order.
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),  # CPU backend; NIXL's choice (legacy "HND")
    "LBNHC": (0, 1, 3, 2, 4),  # GPU default (legacy "NHD")
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_kv_caches(
    layout: str,
    num_layers: int,
    num_blocks: int,
    num_heads: int,
    block_size: int,
    content: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors built the way vLLM 0.32 builds them: one allocation of
    logical shape ``[L, B, H, N, C]`` stored in the memory order that ``layout`` (a
    ``VLLM_LAYOUTS`` name) gives, each layer a ``[B, H, N, C]`` view of it, keyed by
    layer name. ``C`` is ``2 * head_size`` (K then V), or the latent width for MLA
    (``num_heads`` 1, ``content`` 576). Random bytes, so every bit pattern must survive."""
    order = VLLM_LAYOUTS[layout]
    logical = (num_layers, num_blocks, num_heads, block_size, content)
    es = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    phys = [logical[d] for d in order]
    raw = torch.randint(0, 256, (*phys[:-1], phys[-1] * es), dtype=torch.uint8, generator=g).to(device)
    inverse = sorted(range(5), key=lambda i: order[i])
    full = raw.view(dtype).permute(*inverse)
    assert tuple(full.shape) == logical
    return {f"model.layers.{i}.self_attn.attn": full[i] for i in range(num_layers)}


def poison_like(kv_caches: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Same layout, other random bytes (a destination whose every byte is wrong)."""
    first = next(iter(kv_caches.values()))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in kv_caches.items():
        dst = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        storage = int_view(dst).as_strided((dst.untyped_storage().nbytes() // dst.element_size(),), (1,), 0)
        storage.copy_(
            torch.randint(0, 256, (storage.numel() * dst.element_size(),), dtype=torch.uint8, generator=g)
            .view(storage.dtype)
            .to(first.device)
        )
        out[name] = dst
    return out
