"""Paged KV transfers for lmcache-core: CUDA kernels with a pure-torch fallback.

- ``gather_tokens`` / ``scatter_tokens``: per-token K and V through a slot mapping,
  between vLLM 0.32's paged layer tensors ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` and a canonical ``[layers, 2, tokens, kv_heads, head_size]`` buffer.
- ``gather_blocks`` / ``scatter_blocks``: whole blocks, opaque, to/from
  ``[layers, n_blocks, ...]``.
- ``TransferStream``: the same on a side CUDA stream, with events.
- ``backend_name()`` / ``available()`` / ``backend_reason()``: which path runs, and why.

Importing this package compiles nothing; see lmcache_cuda.dispatch for when and how
the kernels are built.
"""

from lmcache_cuda.dispatch import available, backend_name, backend_reason, load_kernels
from lmcache_cuda.paged_layout import PagedLayout, PreparedLayers
from lmcache_cuda.ops import gather_blocks, gather_tokens, scatter_blocks, scatter_tokens
from lmcache_cuda.transfer import TransferEvent, TransferStream

__all__ = [
    "PagedLayout",
    "PreparedLayers",
    "TransferEvent",
    "TransferStream",
    "available",
    "backend_name",
    "backend_reason",
    "gather_blocks",
    "gather_tokens",
    "load_kernels",
    "scatter_blocks",
    "scatter_tokens",
]
