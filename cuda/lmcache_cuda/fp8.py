"""fp8 frames coded on the GPU: a load copies a chunk's fp8 frame (0.516x the bytes of
bfloat16) to the device and decodes it straight into vLLM's paged KV; a save gathers
and encodes on the device and copies the frame out.

The frame is lmcache_core's ``fp8`` codec payload (lmcache_core/fp8.py: one bfloat16
scale per 64 values, then one float8 e4m3fn code per value) of the chunk buffer
``[layers, 2, tokens, heads, head_size]`` (``granularity="tokens"``) or ``[layers,
n_blocks, block_numel]`` (``"blocks"``), bit for bit what the CPU codec writes and
decodes (csrc/fp8_math.cuh; tests/cuda/test_native_fp8_math.py and
tests/cuda/test_fp8_transfers.py hold them together).

- :func:`load` / :func:`load_many`: the frame's bytes go to a device staging buffer on
  a side copy stream, in ``pieces`` parts (the scales with the first), and each part
  is decoded and scattered by one kernel launch on the current stream as soon as it
  has arrived, so the decoding of one part overlaps the copy of the next. A group with
  a bad scale or a float8 NaN code is not written; the returned :class:`Fp8Status`
  says so (the caller then fails the load, and vLLM recomputes those blocks).
- :func:`save` / :func:`save_many`: one kernel launch gathers and encodes a chunk into
  a device frame on the current stream, and a side stream copies it out while the next
  chunk is encoded. NaN or infinite KV makes the status bad (the frame must not be
  stored). The current stream waits for the copies, so a synchronize of it (or of an
  event recorded on it) covers the whole save.

Without the CUDA kernels (CPU tensors, no GPU, a failed build) the same calls run
through lmcache_core's CPU codec and lmcache_cuda's torch reference, synchronously.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

import torch

# the frame's definition, constants and messages live with the CPU codec (this module,
# unlike the rest of lmcache_cuda, needs lmcache_core)
from lmcache_core import fp8 as codec
from lmcache_core.fp8 import GROUP, payload_len
from lmcache_cuda import reference
from lmcache_cuda.dispatch import available, load_kernels
from lmcache_cuda.paged_layout import PagedLayout, check_index, layout_of

__all__ = ["GROUP", "payload_len", "load", "load_many", "save", "save_many", "Fp8Status", "auto_pieces", "describe"]

# status bits (csrc/fp8_math.cuh)
BAD_SCALE = 1
NAN_CODE = 2
NOT_FINITE = 4
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_MESSAGES = {BAD_SCALE: codec._BAD_SCALE, NAN_CODE: codec._NAN_CODE, NOT_FINITE: codec._NOT_FINITE}


def describe(status: int) -> str:
    """The status bits in the CPU codec's words."""
    return "; ".join(msg for bit, msg in _MESSAGES.items() if status & bit) or "fine"


class Fp8Status:
    """What the kernels found wrong with a transfer, once it has run: ``value()``
    waits for the stream the transfer was enqueued on and reads the status word (0:
    fine; else :data:`BAD_SCALE` | :data:`NAN_CODE` | :data:`NOT_FINITE`)."""

    def __init__(self, word: torch.Tensor | int, event: Any = None) -> None:
        self._word = word
        self._event = event

    def value(self) -> int:
        if isinstance(self._word, int):
            return self._word
        if self._event is not None:
            self._event.synchronize()
        return int(self._word.item())

    def ok(self) -> bool:
        return self.value() == 0

    def check(self) -> None:
        """Raise ValueError when the transfer found bad input."""
        v = self.value()
        if v:
            raise ValueError(describe(v))


def _chunk_shape(layout: PagedLayout, index: torch.Tensor, tokens: bool) -> tuple[int, ...]:
    """The chunk buffer the frame encodes."""
    if tokens:
        return layout.token_buffer_shape(index.numel())
    return (layout.num_layers, index.numel(), layout.block_numel)


def _numel(layout: PagedLayout, index: torch.Tensor, tokens: bool) -> int:
    return math.prod(_chunk_shape(layout, index, tokens))


def _check(layout: PagedLayout, index: torch.Tensor, frame: torch.Tensor, granularity: str) -> bool:
    if granularity not in ("tokens", "blocks"):
        raise ValueError(f"granularity={granularity!r}: use 'tokens' or 'blocks'")
    tokens = granularity == "tokens"
    if layout.dtype not in _DTYPE_CODES:
        raise ValueError(f"fp8 frames hold float16, bfloat16 or float32 KV, not {layout.dtype}")
    if not tokens and not layout.blocks_are_dense():
        raise ValueError("block copies need each block to be one dense region: use the token copies instead")
    check_index(index, "slot_mapping" if tokens else "block_ids")
    want = payload_len(_numel(layout, index, tokens))
    if frame.dtype != torch.uint8 or frame.dim() != 1 or not frame.is_contiguous() or frame.numel() != want:
        raise ValueError(
            f"the frame must be a contiguous 1-D uint8 tensor of {want} bytes, got {frame.dtype}{tuple(frame.shape)}"
        )
    return tokens


def _use_kernels(layout: PagedLayout) -> bool:
    return layout.device.type == "cuda" and available()


# -- the reference path: the CPU codec, then the torch copies ---------------------------


def _reference_load(
    kv_caches: Sequence[torch.Tensor], layout: PagedLayout, index: torch.Tensor, frame: torch.Tensor, tokens: bool
) -> int:
    raw = frame.cpu().numpy().data.cast("B")
    try:
        values = codec.Fp8Codec().decode_tensor(raw, layout.dtype, _chunk_shape(layout, index, tokens), None)
    except ValueError as err:
        return NAN_CODE if str(err) == codec._NAN_CODE else BAD_SCALE
    src = values.to(layout.device)
    (reference.scatter_tokens if tokens else reference.scatter_blocks)(kv_caches, index, src)
    return 0


def _reference_save(
    kv_caches: Sequence[torch.Tensor], layout: PagedLayout, index: torch.Tensor, out: torch.Tensor, tokens: bool
) -> int:
    buf = torch.empty(_chunk_shape(layout, index, tokens), dtype=layout.dtype, device=layout.device)
    (reference.gather_tokens if tokens else reference.gather_blocks)(kv_caches, index, buf)
    try:
        frame = codec.Fp8Codec().encode_tensor(buf.cpu())
    except ValueError:
        return NOT_FINITE
    out.copy_(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
    return 0


# -- the kernel path --------------------------------------------------------------------

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    with _streams_lock:
        s = _streams.get(device)
        if s is None:
            s = _streams[device] = torch.cuda.Stream(device, priority=-1)
        return s


def _args(layout: PagedLayout) -> tuple:
    return (
        layout.num_kv_heads,
        layout.head_size,
        layout.block_size,
        layout.num_blocks,
        layout.stride_block,
        layout.stride_head,
        layout.stride_token,
        layout.block_numel,
        _DTYPE_CODES[layout.dtype],
    )


def _start(
    kv_caches: Sequence[torch.Tensor], items: Sequence[tuple[torch.Tensor, torch.Tensor]], granularity: str, reference_fn: Any
) -> Any:
    """What a load or a save starts with: every item checked; then either the
    reference path run to its end (an :class:`Fp8Status`), or, for the kernels, the
    layout, the checked items ``(tokens, index, frame)``, the extension, the layer
    table, the current and the copy stream, a zeroed status word and the geometry."""
    layout = layout_of(kv_caches)
    checked = [(_check(layout, idx, buf, granularity), idx, buf) for idx, buf in items]
    if not _use_kernels(layout):
        found = 0
        for tokens, idx, buf in checked:
            found |= reference_fn(kv_caches, layout, idx, buf, tokens)
        return Fp8Status(found)
    from lmcache_cuda.kernels import table_of

    dev = layout.device
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    return (
        layout,
        checked,
        load_kernels(),
        table_of(kv_caches).ptrs,
        torch.cuda.current_stream(dev),
        _copy_stream(dev),
        status,
        _args(layout),
    )


def _bounds(groups: int, pieces: int) -> list[int]:
    pieces = max(1, min(pieces, groups))
    return [groups * k // pieces for k in range(pieces + 1)]


def load(
    kv_caches: Sequence[torch.Tensor],
    index: torch.Tensor,
    frame: torch.Tensor,
    *,
    granularity: str = "tokens",
    pieces: int | None = None,
) -> Fp8Status:
    """Decode one chunk's fp8 ``frame`` (pinned host or device memory) into the paged KV
    at ``index`` (slot mapping or block ids). See :func:`load_many`."""
    return load_many(kv_caches, [(index, frame)], granularity=granularity, pieces=pieces)


#: a host frame is copied in parts of about this size (at most MAX_PIECES), so that
#: decoding a part overlaps the copy of the next; a part costs about 30 us of host time
PIECE_BYTES = 2 << 20
MAX_PIECES = 4


def auto_pieces(frame_bytes: int, chunks: int) -> int:
    """Parts per chunk: one when several chunks overlap each other already, else one
    per :data:`PIECE_BYTES` of frame, at most :data:`MAX_PIECES`."""
    if chunks > 1:
        return 1
    return max(1, min(MAX_PIECES, frame_bytes // PIECE_BYTES))


def load_many(
    kv_caches: Sequence[torch.Tensor],
    items: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    granularity: str = "tokens",
    pieces: int | None = None,
) -> Fp8Status:
    """Decode several chunks' frames ``(index, frame)`` into the paged KV: host frames are
    copied on a side stream, each in ``pieces`` parts (default :func:`auto_pieces`), and
    each part's decode waits (on the GPU) for its own part only. The caller keeps the
    frames alive and unchanged until the current stream has passed this point."""
    step = _start(kv_caches, items, granularity, _reference_load)
    if isinstance(step, Fp8Status):
        return step
    layout, checked, k, ptrs, current, copier, status, args = step
    dev = layout.device
    limit = codec.scale_limit(layout.dtype)
    # every copy first (one pass on the side stream), then every decode on the current
    # stream, each waiting for its part's event: the GPU overlaps them all the same
    plan: list[tuple[bool, torch.Tensor, torch.Tensor, list[tuple[int, int, Any]]]] = []  # [(g0, g1, event or None)]
    copier.wait_stream(current)  # the staging memory and the KV are the current stream's
    with torch.cuda.stream(copier):
        for tokens, idx, frame in checked:
            n = _numel(layout, idx, tokens)
            groups = -(-n // GROUP)
            if frame.device == dev:
                plan.append((tokens, idx, frame, [(0, groups, None)]))
                continue
            staged = torch.empty_like(frame, device=dev)
            parts: list[tuple[int, int, Any]] = []
            bounds = _bounds(groups, pieces if pieces is not None else auto_pieces(frame.numel(), len(checked)))
            for p in range(len(bounds) - 1):
                g0, g1 = bounds[p], bounds[p + 1]
                lo = 0 if p == 0 else 2 * groups + GROUP * g0  # the scales go with the first part
                hi = 2 * groups + min(GROUP * g1, n)
                staged[lo:hi].copy_(frame[lo:hi], non_blocking=True)
                done = torch.cuda.Event()
                done.record(copier)
                parts.append((g0, g1, done))
            staged.record_stream(copier)
            plan.append((tokens, idx, staged, parts))
    for tokens, idx, staged, parts in plan:
        index = idx.to(dev, torch.int64, non_blocking=True).contiguous()
        for g0, g1, done in parts:
            if done is not None:
                current.wait_event(done)
            err = k.fp8_scatter(ptrs, index, staged, status, tokens, *args, limit, g0, g1)
            if err:
                raise ValueError(err)
    event = torch.cuda.Event()
    event.record(current)
    return Fp8Status(status, event)


def save(kv_caches: Sequence[torch.Tensor], index: torch.Tensor, out: torch.Tensor, *, granularity: str = "tokens") -> Fp8Status:
    """Gather and encode one chunk at ``index`` into ``out`` (a pinned host or device
    uint8 tensor of :func:`payload_len` bytes). See :func:`save_many`."""
    return save_many(kv_caches, [(index, out)], granularity=granularity)


def save_many(
    kv_caches: Sequence[torch.Tensor], items: Sequence[tuple[torch.Tensor, torch.Tensor]], *, granularity: str = "tokens"
) -> Fp8Status:
    """Gather and encode several chunks ``(index, out)``: each is encoded by one launch
    on the current stream (after the work already queued there, so a save sees freshly
    written KV), then copied out on a side stream while the next is encoded; the current
    stream waits for the copies. Keep ``out`` unread until then."""
    step = _start(kv_caches, items, granularity, _reference_save)
    if isinstance(step, Fp8Status):
        return step
    layout, checked, k, ptrs, current, copier, status, args = step
    dev = layout.device
    consts = (codec._ROUND_UP / codec.FP8_MAX, codec.MIN_SCALE, codec.scale_limit(layout.dtype))
    for tokens, idx, out in checked:
        index = idx.to(dev, torch.int64, non_blocking=True).contiguous()
        n = _numel(layout, idx, tokens)
        target = out if out.device == dev else torch.empty_like(out, device=dev)
        err = k.fp8_gather(ptrs, index, target, status, tokens, *args, *consts, 0, -(-n // GROUP))
        if err:
            raise ValueError(err)
        if target is not out:
            copier.wait_stream(current)
            with torch.cuda.stream(copier):
                out.copy_(target, non_blocking=True)
            target.record_stream(copier)
    current.wait_stream(copier)
    event = torch.cuda.Event()
    event.record(current)
    return Fp8Status(status, event)
