"""Layout adapters: move KV between vLLM's paged per-layer tensors and chunk buffers.

vLLM 0.32 hands connectors one tensor per attention layer with the logical shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (``[B, H, N, C]``: K is the
first ``head_size`` of C, V the second; MLA has H = 1 and C = the latent width, e.g.
576). The physical order behind it is one of vLLM's ``KVCacheLayout`` stride
permutations (``VLLM_KV_CACHE_LAYOUT``; the GPU default ``LBNHC`` stores each block as
``[N, H, C]``, the CPU backend ``LBHNC`` as ``[H, N, C]``; the ``BL..`` layouts put one
block of every layer side by side). The attention kernels' block may also be a fraction
of the scheduler's (hybrid models on GPU): ``N`` then divides ``block_size``.

* :class:`BlockLayout` copies whole blocks as opaque memory: chunk buffer
  ``[num_layers, n_blocks, *block]`` holding each block's bytes in memory order, the
  same on the torch path and the CUDA kernels. Correct for every attention backend,
  including vLLM's CPU backend whose in-block layout is ISA-dependent, because it
  never looks inside a block. Its fingerprint therefore includes the CPU's ISA and the
  in-block memory order: blocks written under another layout miss instead of loading
  bytes in the wrong order. Needs each block to be one dense region (not so for
  ``LHBNC``/``BHLNC``: use the token adapter there).
* :class:`TokenLayout` gathers per-token K and V through the slot mapping into the
  canonical ``[num_layers, 2, n_tokens, num_kv_heads, head_size]``: portable across
  block sizes and stride orders, valid only where the logical shape is what the
  attention kernels read (GPU backends). Refused on CPU.

The fingerprint goes into the key namespace, so caches written with another adapter,
shape, dtype or block size miss instead of loading garbage.

On CUDA, copies between the KV tensors and host (pool) buffers are enqueued on the
current stream and finished (``finish``) before a buffer is handed to the cache or
given back to the pool; :mod:`lmcache_connector.transfers.layerwise` overlaps them with the
forward pass instead.
"""

from __future__ import annotations

import functools
import platform
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
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
            raise LayoutError(
                f"layer {name}: expected a 4-d paged KV tensor [blocks, heads, tokens, content], got shape {list(t.shape)}"
            )
        if t.stride() != first.stride():
            raise LayoutError(
                f"layer {name} has strides {t.stride()}, the first layer {first.stride()}: mixed layouts are not supported"
            )
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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the integer dtype of its element size: copies through it are bit-exact
    and work for every dtype (fp8 has no indexed copies on CPU)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


_DIMS = "hnc"  # the names of dims 1, 2, 3 of a [B, H, N, C] layer tensor


def block_memory_order(t: torch.Tensor) -> str | None:
    """The memory order of one block's dims, outermost first, over ``"hnc"`` (size-1
    dims left out: ``"hnc"`` for vLLM's ``LBHNC``, ``"nhc"`` for ``LBNHC``, ``"nc"`` for
    MLA), or None when a block is not one dense region (``LHBNC``, ``BHLNC``)."""
    dims = sorted((d for d in (1, 2, 3) if t.shape[d] != 1), key=lambda d: t.stride(d), reverse=True)
    expected = 1
    for d in reversed(dims):
        if t.stride(d) != expected:
            return None
        expected *= t.shape[d]
    if t.shape[0] > 1 and abs(t.stride(0)) < expected:
        return None
    return "".join(_DIMS[d - 1] for d in dims)


class _PinnedRing:
    """Pinned host buffers for the small index uploads (slot mappings, block ids), reused
    in turn once the copy that read one has run (an event per buffer). A buffer whose
    copy is still queued is skipped and, up to ``MAX`` buffers, a new one is made, so an
    upload never waits for the GPU's queue; past ``MAX`` the oldest is waited for.
    ``Tensor.pin_memory()`` per upload was seen to cost 0.1-2.5 ms on a GPU host (a
    pointer query of the pageable source and the pinned allocator). Thread-safe: a
    background save thread and the model's thread may upload at once."""

    MAX = 64

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._next = 0
        self._lock = threading.Lock()

    def _slot(self, n: int) -> int:
        for k in range(len(self._bufs)):
            i = (self._next + k) % len(self._bufs)
            if self._events[i].query():
                break
        else:
            if len(self._bufs) < self.MAX:
                self._bufs.append(torch.empty(0, dtype=torch.int64))
                self._events.append(torch.cuda.Event())
                i = len(self._bufs) - 1
            else:
                i = self._next % len(self._bufs)
                self._events[i].synchronize()
        self._next = i + 1
        if self._bufs[i].numel() < n:
            self._bufs[i] = torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=True)
        return i

    def upload(self, arr: np.ndarray, device: torch.device) -> torch.Tensor:
        n = int(arr.size)
        with self._lock:  # a slot is taken, filled and its copy recorded as one step
            i = self._slot(n)
            host = self._bufs[i][:n]
            host.numpy()[:] = arr
            out = host.to(device, non_blocking=True)
            self._events[i].record(torch.cuda.current_stream(device))
        return out


@dataclass
class _StepPlan:
    """One layer of a step's chunks, worked out once (see ``plan_layers``): the byte
    ranges between the chunk buffers and a device staging buffer (each chunk's slice
    of a layer sits at ``bases[i] + layer * per_layer[i]``: ``rows[i]`` rows of
    ``width[i]`` bytes, ``chunk_pitch[i]`` apart there and ``stage_pitch[i]`` apart in
    the staging buffer, moved by one DMA), and the kernel copies between the staging
    buffer and the KV, checked once (``copies()``: built at the step's start for the
    layer pipeline; in ``copy_many`` after a load's DMAs are enqueued, so the index
    upload and the checks run on the host while they move)."""

    load: bool
    tensors: list[torch.Tensor]
    bases: list[int]
    per_layer: list[int]
    chunk_pitch: list[int]
    stage_off: list[int]
    stage_pitch: list[int]
    width: list[int]
    rows: list[int]
    make_copies: Callable[[], Any]  # builds the lmcache_cuda LayerCopies (uploads the index)
    staging_shape: tuple[int, ...]
    copy_rows: Any = None  # lmcache_cuda's copy_rows for these tensors
    staging: torch.Tensor | None = None  # allocated by the first run, on the copies' stream
    steps: list[tuple[Any, Any] | None] | None = None  # per layer: (the DMAs, the kernel), bound at first use
    built: Any = None  # make_copies()'s result

    def copies(self) -> Any:
        if self.built is None:
            self.built = self.make_copies()
        return self.built


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
        # The attention kernels' block (N) may be a fraction of the scheduler's block.
        self.kernel_block = int(first.shape[2])
        if self.kernel_block <= 0 or block_size % self.kernel_block:
            raise LayoutError(
                f"KV tensors hold blocks of {self.kernel_block} tokens, which does not divide vLLM's block size {block_size}"
            )
        self.ratio = block_size // self.kernel_block
        self._idx: dict[tuple[Any, ...], torch.Tensor] | None = None
        self._idx_users = 0
        self._sets: dict[tuple[int, int], Sequence[torch.Tensor]] = {}
        self._uploads = _PinnedRing() if self.device.type == "cuda" else None

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        """``ids`` as a long tensor on the KV device, copied from pinned memory without
        blocking the host (a blocking copy would wait for everything queued on the
        stream). Cached while :meth:`cache_indices` is on (layer-by-layer copies reuse
        one table per chunk): every use is then on the stream that made it."""
        key = tuple(ids)
        if self._idx is not None and key in self._idx:
            return self._idx[key]
        idx = self._to_device(np.asarray(key, dtype=np.int64))
        if self._idx is not None:
            self._idx[key] = idx
        return idx

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        """An int64 host array as a tensor on the KV device, on the current stream,
        without blocking the host: through a pinned buffer of our own (see
        _PinnedRing)."""
        if self._uploads is None:
            return torch.from_numpy(arr)
        return self._uploads.upload(arr, self.device)

    def cache_indices(self, on: bool) -> None:
        """Keep index tables between calls (on) or drop them (off); see ``_index``."""
        self._idx_users = max(0, self._idx_users + (1 if on else -1))
        if self._idx_users and self._idx is None:
            self._idx = {}
        elif not self._idx_users:
            self._idx = None

    def finish(self) -> None:
        """Wait until the copies enqueued on the current CUDA stream are done, so host
        buffers may be read, stored or reused (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _which(self, layer: int | None) -> range:
        return range(self.num_layers) if layer is None else range(layer, layer + 1)

    def _set(self, which: range) -> Sequence[torch.Tensor]:
        """The layers ``which`` for lmcache_cuda: prepared once (validated, their
        address table built) so each copy skips that work."""
        key = (which.start, which.stop)
        got = self._sets.get(key)
        if got is None:
            layers = self.layers[which.start : which.stop]
            try:
                from lmcache_cuda.paged_layout import PreparedLayers

                got = PreparedLayers(layers)
            except (ImportError, ValueError):  # an older lmcache_cuda, or a layout its checks refuse
                got = layers
            self._sets[key] = got
        return got

    # -- one layer of several chunks (layerwise.py) ---------------------------------------
    def plan_layers(self, items: Sequence[Any], load: bool) -> Any:
        """What every layer of ``items`` needs, worked out once per step: chunks with
        ``.buf.tensor``, ``.block_ids``, ``.lo``, ``.hi`` (and ``.write_from`` for loads)."""
        if self._ops is None:
            return (list(items), load)
        plan = self._plan(items, load)
        if plan is not None:
            plan.copies()  # here, at the step's start, as the layer pipeline was measured
        return plan

    def run_layer(self, plan: Any, layer: int) -> None:
        """Enqueue layer ``layer`` of a planned step; nothing is waited for. With the
        CUDA kernels the chunks' slices meet in one device staging buffer (one DMA
        each) and one kernel call moves them all, so the host's cost per layer does
        not grow with a kernel call per chunk."""
        if self._ops is None:
            items, load = plan
            self._each_chunk(items, load, layer=layer)
            return
        self._run(plan, layer)

    def _each_chunk(self, items: Sequence[Any], load: bool, **kw: Any) -> None:
        """The torch path: ``load_chunk`` or ``save_chunk`` for each item in turn."""
        for it in items:
            if load:
                self.load_chunk(it.buf.tensor, it.block_ids, it.lo, it.hi, it.write_from, **kw)
            else:
                self.save_chunk(it.block_ids, it.lo, it.hi, it.buf.tensor, **kw)

    def copy_many(self, items: Sequence[Any], load: bool) -> None:
        """Every layer of several chunks (items as for ``plan_layers``), enqueued on
        the current stream; call ``finish`` before the buffers are read or reused. With
        the CUDA kernels: one kernel call for all of them and one 2-D DMA per chunk
        (a chunk's layers are evenly spaced rows in its buffer and in the staging
        buffer), so a step's host work does not grow with a full call per chunk."""
        if self._ops is None:
            self._each_chunk(items, load, wait=False)
            return
        plan = self._plan(items, load)
        if plan is None:
            return
        shape = (self.num_layers, *plan.staging_shape[1:])
        staging = torch.empty(shape, dtype=self.dtype, device=self.device)
        layer_bytes = staging[0].numel() * staging.element_size()
        rows, chunk_pitch, stage_pitch = [], [], []
        for r, cp, sp, per_layer in zip(plan.rows, plan.chunk_pitch, plan.stage_pitch, plan.per_layer):
            if r == 1:  # one row per layer: the layers are the rows
                cp, sp = per_layer, layer_bytes
            elif per_layer != r * cp or layer_bytes != r * sp:  # not evenly spaced: layer by layer
                for layer in range(self.num_layers):
                    self._run(plan, layer)
                return
            rows.append(r * self.num_layers)
            chunk_pitch.append(cp)
            stage_pitch.append(sp)
        stage = [staging] * len(rows)
        if load:  # the DMAs first: the index upload and the checks then overlap them
            plan.copy_rows(stage, plan.stage_off, stage_pitch, plan.tensors, plan.bases, chunk_pitch, plan.width, rows)
            plan.copies().run_all(staging, False)
        else:
            plan.copies().run_all(staging, True)
            plan.copy_rows(plan.tensors, plan.bases, chunk_pitch, stage, plan.stage_off, stage_pitch, plan.width, rows)

    def load_layer(self, items: Sequence[Any], layer: int) -> None:
        self.run_layer(self.plan_layers(items, True), layer)

    def save_layer(self, items: Sequence[Any], layer: int) -> None:
        self.run_layer(self.plan_layers(items, False), layer)

    def save_chunk(
        self, block_ids: Sequence[int], lo: int, hi: int, out: torch.Tensor, layer: int | None = None, wait: bool = True
    ) -> None:
        """Gather tokens ``lo..hi`` of a request (the blocks holding them, for the block
        adapter) into ``out``. All layers: finished on return unless ``wait`` is false
        (then call ``finish`` before reading ``out``); one ``layer``: left enqueued
        (see layerwise.py)."""
        self._save_range(block_ids, lo, hi, out, layer)
        if layer is None and wait:
            self.finish()

    def load_chunk(
        self,
        buf: torch.Tensor,
        block_ids: Sequence[int],
        lo: int,
        hi: int,
        write_from: int,
        layer: int | None = None,
        wait: bool = True,
    ) -> None:
        """Write chunk ``buf`` (tokens ``lo..hi``) into the request's blocks, never
        before token ``write_from`` (vLLM's own prefix-cache blocks, which may be shared
        with other requests and must never be written). All layers: finished on return
        (``buf`` may be reused) unless ``wait`` is false; one ``layer``: left enqueued."""
        self._load_range(buf, block_ids, lo, hi, write_from, layer)
        if layer is None and wait:
            self.finish()

    def _save_range(self, block_ids: Sequence[int], lo: int, hi: int, out: torch.Tensor, layer: int | None) -> None:
        raise NotImplementedError

    def _load_range(
        self, buf: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, write_from: int, layer: int | None
    ) -> None:
        raise NotImplementedError

    def _plan(self, items: Sequence[Any], load: bool) -> _StepPlan | None:
        raise NotImplementedError

    def _step_plan(
        self, load: bool, pieces: list[tuple], index: Callable[[], torch.Tensor], granularity: str, shape: tuple
    ) -> _StepPlan:
        """``pieces``: (chunk tensor, its byte offset at layer 0, its bytes per layer,
        its row pitch, the staging byte offset, the staging row pitch, the row width,
        the rows); ``index`` makes the device index, at the plan's first use."""
        ops, layers = self._ops, self._set(range(self.num_layers))
        tensors, bases, per_layer, chunk_pitch, stage_off, stage_pitch, width, rows = (list(c) for c in zip(*pieces))
        return _StepPlan(
            load=load,
            tensors=tensors,
            bases=bases,
            per_layer=per_layer,
            chunk_pitch=chunk_pitch,
            stage_off=stage_off,
            stage_pitch=stage_pitch,
            width=width,
            rows=rows,
            make_copies=lambda: ops.layer_copies(layers, index(), granularity),
            staging_shape=shape,
            copy_rows=self._ops.copy_rows_for(self.layers),
        )

    def _run(self, plan: _StepPlan | None, layer: int) -> None:
        """One layer of a planned step: loads move the chunks' slices to the staging
        buffer (one native call, a DMA each) and scatter it into the KV with one
        kernel; saves gather, then move. Everything is enqueued on the current stream,
        which also orders the staging buffer's reuse from layer to layer."""
        if plan is None:
            return
        if plan.steps is None:
            self._bind(plan)
        assert plan.steps is not None
        step = plan.steps[layer]
        if step is None:
            step = plan.steps[layer] = self._bind_layer(plan, layer)
        dmas, kernel = step
        if plan.load:
            dmas()
            kernel()
        else:
            kernel()
            dmas()

    def _bind(self, plan: _StepPlan) -> None:
        """Allocate the staging buffer (on the current stream: its reuse is then ordered
        by that stream); each layer's calls are bound at its first run, so a layer
        costs the host two calls and no argument handling."""
        plan.staging = torch.empty(plan.staging_shape, dtype=self.dtype, device=self.device)
        plan.steps = [None] * self.num_layers

    def _bind_layer(self, plan: _StepPlan, layer: int) -> tuple[Any, Any]:
        staging = plan.staging
        assert staging is not None
        stage = [staging] * len(plan.tensors)
        chunk_off = [b + layer * p for b, p in zip(plan.bases, plan.per_layer)]
        if plan.load:
            args = (stage, plan.stage_off, plan.stage_pitch, plan.tensors, chunk_off, plan.chunk_pitch, plan.width, plan.rows)
        else:
            args = (plan.tensors, chunk_off, plan.chunk_pitch, stage, plan.stage_off, plan.stage_pitch, plan.width, plan.rows)
        return functools.partial(plan.copy_rows, *args), plan.copies().bind(layer, staging, not plan.load)


class BlockLayout(_PagedLayers):
    kind = "block"

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        super().__init__(kv_caches, block_size)
        first = self.layers[0]
        order = block_memory_order(first)
        if order is None:
            raise LayoutError(
                f"layout: block needs each KV block to be one dense region; these tensors (shape {list(first.shape)}, "
                f"strides {first.stride()}) are not (vLLM's LHBNC/BHLNC layouts): use layout: token"
            )
        logical = "".join(_DIMS[d - 1] for d in (1, 2, 3) if first.shape[d] != 1)
        self.order_tag = "" if order == logical else f"/mem-{order}"
        self.block_shape = tuple(first.shape[1:]) if not self.order_tag else tuple(first.shape[1 + _DIMS.index(c)] for c in order)
        self.block_numel = int(first[0].numel()) if first.shape[0] else 0
        # Each layer as [kernel blocks, block_numel]: a block's elements in memory order.
        self.pages = [
            bits(t).as_strided((t.shape[0], self.block_numel), (t.stride(0), 1), t.storage_offset()) for t in self.layers
        ]

    def fingerprint(self) -> str:
        return (
            f"block/v1/{isa_tag(self.device)}/{str(self.dtype).removeprefix('torch.')}/"
            f"L{self.num_layers}/bs{self.block_size}/{'x'.join(map(str, self.block_shape))}{self.order_tag}"
        )

    def chunk_shape(self, n_tokens: int) -> tuple[int, ...]:
        n_blocks = -(-n_tokens // self.block_size) * self.ratio
        return (self.num_layers, n_blocks, *self.block_shape)

    def _kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        if self.ratio == 1:
            return list(block_ids)
        return [b * self.ratio + j for b in block_ids for j in range(self.ratio)]

    def gather(self, block_ids: Sequence[int], out: torch.Tensor, layer: int | None = None) -> None:
        """Copy blocks ``block_ids`` (vLLM's) of every layer (or of ``layer``) into
        ``out[:, :n]``, each block's elements in memory order."""
        ids = self._kernel_ids(block_ids)
        n = len(ids)
        if n == 0:
            return
        if self._ops is not None:
            which = self._which(layer)
            self._ops.gather_blocks(self._set(which), self._index(ids), out[which.start : which.stop, :n])
            return
        runs = block_runs(ids)
        for i in self._which(layer):
            pages, dst = self.pages[i], bits(out[i, :n]).view(n, self.block_numel)
            if runs is not None:
                for pos, first, count in runs:
                    dst[pos : pos + count].copy_(pages[first : first + count], non_blocking=True)
            elif pages.device == dst.device:
                torch.index_select(pages, 0, self._index(ids), out=dst)
            else:
                dst.copy_(pages.index_select(0, self._index(ids)), non_blocking=True)

    def _save_range(self, block_ids: Sequence[int], lo: int, hi: int, out: torch.Tensor, layer: int | None) -> None:
        bs = self.block_size
        self.gather(block_ids[lo // bs : -(-hi // bs)], out, layer)

    def _load_range(
        self, buf: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, write_from: int, layer: int | None
    ) -> None:
        bs = self.block_size
        first_block = max(lo, write_from) // bs
        last_block = min(-(-hi // bs), len(block_ids))
        if last_block > first_block:
            self.scatter(buf, block_ids[first_block:last_block], first=(first_block - lo // bs) * self.ratio, layer=layer)

    def scatter(self, buf: torch.Tensor, block_ids: Sequence[int], first: int = 0, layer: int | None = None) -> None:
        """Write ``buf[:, first:first+n]`` (``n`` kernel blocks) into blocks ``block_ids``."""
        ids = self._kernel_ids(block_ids)
        n = len(ids)
        if n == 0:
            return
        which = self._which(layer)
        if self._ops is not None:
            src = buf[which.start : which.stop, first : first + n]
            self._ops.scatter_blocks(self._set(which), self._index(ids), src.contiguous())
            return
        runs = block_runs(ids)
        for i in which:
            pages, src = self.pages[i], bits(buf[i, first : first + n]).reshape(n, self.block_numel)
            if runs is not None:
                for pos, start, count in runs:
                    pages[start : start + count].copy_(src[pos : pos + count], non_blocking=True)
                continue
            if src.device != pages.device:
                src = src.to(pages.device, non_blocking=True)
            pages.index_copy_(0, self._index(ids), src)

    def _segments(self, items: Sequence[Any], load: bool) -> list[tuple[torch.Tensor, int, list[int]]]:
        """(chunk tensor, first kernel block in it, kernel block ids) per item."""
        bs, segs = self.block_size, []
        for it in items:
            lo, hi = it.lo, it.hi
            first_block = max(lo, it.write_from) // bs if load else lo // bs
            last_block = min(-(-hi // bs), len(it.block_ids))
            if last_block > first_block:
                ids = self._kernel_ids(it.block_ids[first_block:last_block])
                segs.append((it.buf.tensor, (first_block - lo // bs) * self.ratio, ids))
        return segs

    def _plan(self, items: Sequence[Any], load: bool) -> _StepPlan | None:
        segs = self._segments(items, load)
        if not segs:
            return None
        ids_all = [b for _, _, ids in segs for b in ids]
        es = torch.empty((), dtype=self.dtype).element_size()
        row = self.block_numel * es
        pieces, off = [], 0
        for t, first, ids in segs:
            n = len(ids)
            pieces.append((t, first * t.stride(1) * es, t.stride(0) * es, 0, off * row, 0, n * row, 1))
            off += n
        return self._step_plan(load, pieces, lambda: self._index(ids_all), "blocks", (1, off, *self.block_shape))


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
        nb, heads, _, two_d = self.layers[0].shape
        if two_d % 2 or self.layers[0].stride(3) != 1:
            raise LayoutError(
                f"unexpected KV shape {list(self.layers[0].shape)} (strides {self.layers[0].stride()}): "
                "the last dim must be dense and hold K then V"
            )
        self.num_heads = heads
        self.head_size = two_d // 2
        self._offs = np.arange(block_size, dtype=np.int64)  # token offsets in a block

    def fingerprint(self) -> str:
        # Block size is deliberately absent: token chunks are portable across it.
        return f"token/v1/{str(self.dtype).removeprefix('torch.')}/L{self.num_layers}/h{self.num_heads}/d{self.head_size}"

    def chunk_shape(self, n_tokens: int) -> tuple[int, ...]:
        return (self.num_layers, 2, n_tokens, self.num_heads, self.head_size)

    def slot_mapping(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Slots (in the KV tensors' own blocks) of token positions ``start..end``,
        worked out on the host and copied over once (cached with the index tables)."""
        return self._slots_many([(block_ids, start, end)])

    def _slots_many(self, ranges: Sequence[tuple[Sequence[int], int, int]]) -> torch.Tensor:
        key = (-1, *((start, end, *ids) for ids, start, end in ranges))
        if self._idx is not None and key in self._idx:
            return self._idx[key]
        bs = self.block_size
        parts = []
        for ids, start, end in ranges:
            b0, b1 = start // bs, -(-end // bs)
            if b1 > len(ids):
                raise IndexError(f"tokens {start}..{end} need {b1} blocks, the request has {len(ids)}")
            # numpy: a few microseconds, where the same in torch ops costs tens (per chunk copied)
            rows = np.asarray(ids[b0:b1], dtype=np.int64)[:, None] * bs + self._offs
            parts.append(rows.reshape(-1)[start - b0 * bs : end - b0 * bs])
        slots = self._to_device(parts[0] if len(parts) == 1 else np.concatenate(parts))
        if self._idx is not None:
            self._idx[key] = slots
        return slots

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block index, offset) of token positions ``start..end`` of a request."""
        s = self.slot_mapping(block_ids, start, end)
        return s // self.kernel_block, s % self.kernel_block

    def _save_range(self, block_ids: Sequence[int], lo: int, hi: int, out: torch.Tensor, layer: int | None) -> None:
        self.gather_tokens(block_ids, lo, hi, out, layer)

    def _load_range(
        self, buf: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, write_from: int, layer: int | None
    ) -> None:
        start = max(lo, write_from)
        if hi > start:
            self.scatter_tokens(buf, block_ids, start, hi, first=start - lo, layer=layer)

    def gather_tokens(self, block_ids: Sequence[int], start: int, end: int, out: torch.Tensor, layer: int | None = None) -> None:
        which = self._which(layer)
        n = end - start
        if self._ops is not None:
            dst = out[which.start : which.stop, :, :n]
            self._ops.gather_tokens(self._set(which), self.slot_mapping(block_ids, start, end), dst)
            return
        blk, off = self.slots(block_ids, start, end)
        d = self.head_size
        o = bits(out)
        for i in which:
            per_tok = bits(self.layers[i]).transpose(1, 2)[blk, off]  # [T, H, 2D]
            o[i, 0, :n].copy_(per_tok[..., :d], non_blocking=True)
            o[i, 1, :n].copy_(per_tok[..., d:], non_blocking=True)

    def scatter_tokens(
        self, buf: torch.Tensor, block_ids: Sequence[int], start: int, end: int, first: int = 0, layer: int | None = None
    ) -> None:
        which = self._which(layer)
        n = end - start
        if self._ops is not None:
            src = buf[which.start : which.stop, :, first : first + n].contiguous()
            self._ops.scatter_tokens(self._set(which), self.slot_mapping(block_ids, start, end), src)
            return
        blk, off = self.slots(block_ids, start, end)
        b = bits(buf)
        for i in which:
            kv = bits(self.layers[i])
            k = b[i, 0, first : first + n].to(kv.device, non_blocking=True)
            v = b[i, 1, first : first + n].to(kv.device, non_blocking=True)
            kv.transpose(1, 2)[blk, off] = torch.cat([k, v], dim=-1)

    def _plan(self, items: Sequence[Any], load: bool) -> _StepPlan | None:
        segs, ids_all = [], []
        for it in items:
            start = max(it.lo, it.write_from) if load else it.lo
            if it.hi > start:
                segs.append((it.buf.tensor, start - it.lo, it.hi - start))
                ids_all.append((it.block_ids, start, it.hi))
        if not segs:
            return None
        total = sum(n for _, _, n in segs)
        es = torch.empty((), dtype=self.dtype).element_size()
        row = self.num_heads * self.head_size * es  # one token's K (or V) of one layer
        pieces, off = [], 0
        for t, first, n in segs:
            # K and V of the chunk's layer ([layers, 2, tokens, heads, head_size]) as two
            # rows of one DMA: to offset ``off`` of the staging's K and V halves
            pieces.append((t, first * t.stride(2) * es, t.stride(0) * es, t.stride(1) * es, off * row, total * row, n * row, 2))
            off += n
        return self._step_plan(
            load, pieces, lambda: self._slots_many(ids_all), "tokens", (1, 2, total, self.num_heads, self.head_size)
        )


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
