"""Layer-by-layer KV transfers (``connector.layerwise: true`` in ``kv_connector_extra_config``).

Without it a step's synchronous loads finish in ``start_load_kv`` before the forward
pass starts, and its saves gather every layer in ``wait_for_save`` after the forward.
With it, on a CUDA device (dense layouts: block and token adapters):

* loads: the chunks are read from the cache on the host first (a miss fails the
  same chunks as before, before anything is enqueued); the first layer's copies are
  enqueued on a side CUDA stream (high priority, so its short kernels are not queued
  behind the forward pass's), one event per layer. vLLM calls
  ``wait_for_layer_load(layer)`` before each attention layer: it makes the compute
  stream wait for that layer's event on the GPU (the host never blocks) and enqueues
  the next layer if needed. ``save_kv_layer(layer)``, called after each attention
  layer, enqueues the copies up to ``LOOKAHEAD`` layers further: the host's
  enqueueing then runs while the GPU computes the layer just launched, instead of
  delaying a launch. Layer ``i`` loads while layers ``< i`` compute;
* saves: ``save_kv_layer(layer)``, called after each attention layer, enqueues that
  layer's gather into the chunk buffers on the side stream, ordered after the
  compute already queued; ``wait_for_save`` waits for the side stream and stores.

Safety nets: a layer that vLLM never handed to ``save_kv_layer`` is gathered in
``wait_for_save`` (the KV is final then), so a stored chunk always has every layer.
A step whose loads were not waited for layer by layer (an unknown layer name, or a
step that ended with layers never waited for) turns the pipeline off for the
engine's lifetime, with a warning: later steps load everything before the forward.

On CPU the same calls run synchronously (loads all at once before the forward, saves
layer by layer as vLLM hands them over): nothing overlaps, nothing changes in what is
stored or loaded; the CPU tests run this path to keep it correct.

The module needs torch only (no vLLM), so the GPU check can drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from ..log import get_logger

log = get_logger(__name__)

LOOKAHEAD = 3  # layers whose copies are enqueued ahead of the layer being waited for


class ChunkBuffer(Protocol):
    """A chunk's memory as a transfer holds it: a pool buffer
    (:class:`~lmcache_core.memory.MemoryBuffer`) or a :class:`Borrowed` tensor."""

    @property
    def tensor(self) -> torch.Tensor: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class Borrowed:
    """A tensor a transfer reads but does not own (a chunk the caller releases
    itself): :meth:`release` does nothing."""

    tensor: torch.Tensor

    def release(self) -> None:
        pass


@dataclass
class LoadItem:
    """One chunk to write into vLLM's blocks."""

    buf: ChunkBuffer
    block_ids: Sequence[int]
    lo: int
    hi: int
    write_from: int


@dataclass
class SaveItem:
    """One chunk to gather from vLLM's blocks into ``buf``; ``payload`` is the caller's."""

    buf: Any
    block_ids: Sequence[int]
    lo: int
    hi: int
    payload: Any = None
    layers: set[int] = field(default_factory=set)


class LayerPipeline:
    def __init__(self, layout: Any, layer_names: Sequence[str], *, priority: int = -1) -> None:
        """``layout``: a BlockLayout or TokenLayout over the same layers, in the same
        order as ``layer_names`` (vLLM's ``register_kv_caches`` order). ``priority``:
        the side stream's CUDA priority (lower is higher; torch clamps it to the
        device's range)."""
        self.layout = layout
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(layer_names)
        self.device = layout.device
        self.cuda = self.device.type == "cuda"
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device=self.device, priority=priority) if self.cuda else None
        self._after_layer_seen = False  # save_kv_layer calls enqueue ahead (else wait_layer does)
        # One event per layer, made once and recorded again each step (a step's waits
        # are all enqueued, and its last event waited for, before the next step records).
        self._layer_events = [torch.cuda.Event() for _ in layer_names] if self.cuda else []
        self.disabled = False
        self._load_events: list[torch.cuda.Event] = []
        self._load_bufs: list[Any] = []
        self._items: list[LoadItem] = []  # this step's loads (CUDA), enqueued layer by layer
        self._next = 0  # the next layer to enqueue
        self._ready: torch.cuda.Event | None = None
        self._step_loads = False  # this step loaded something (wait_layer calls are checked)
        self._load_plan: Any = None
        self._save_plan: Any = None
        self._waited = -1  # highest layer the compute stream waited for this step
        self._saves: list[SaveItem] | None = None
        # counters (stats)
        self.pipelined_loads = 0
        self.pipelined_saves = 0
        self.late_save_layers = 0

    @property
    def active(self) -> bool:
        return not self.disabled

    # -- loads ------------------------------------------------------------------------
    def load(self, items: list[LoadItem]) -> None:
        """Start this step's loads (call once per step, before the forward pass)."""
        if not items:
            return
        self._load_bufs.extend(it.buf for it in items)
        self._step_loads = True
        self._waited = -1
        self.pipelined_loads += len(items)
        if self.stream is None:  # synchronous: every layer now, the same copies as on a GPU
            plan = self.layout.plan_layers(items, True)
            for layer in range(self.num_layers):
                self.layout.run_layer(plan, layer)
            return
        self._items = items
        self._next = 0
        self.layout.cache_indices(True)
        # The plan's index tables are copied on the compute stream: the side stream
        # waits for them, and for the work queued before the step (block zeroing).
        self._load_plan = self.layout.plan_layers(items, True)
        self._ready = torch.cuda.current_stream(self.device).record_event()
        self._enqueue_until(0)

    def _enqueue_until(self, last: int) -> None:
        """Enqueue the loads of layers up to ``last`` on the side stream."""
        last = min(last, self.num_layers - 1)
        if not self._items or self._next > last:
            return
        stream = self.stream
        assert stream is not None
        with torch.cuda.stream(stream):
            if self._next == 0 and self._ready is not None:
                stream.wait_event(self._ready)
            run, plan, events = self.layout.run_layer, self._load_plan, self._layer_events
            while self._next <= last:
                run(plan, self._next)
                ev = events[self._next]
                ev.record(stream)
                self._load_events.append(ev)
                self._next += 1

    def wait_layer(self, name: str) -> None:
        """``wait_for_layer_load``: the compute stream waits (on the GPU) until this
        layer's loads, and every earlier layer's, are in place. On CPU the loads are
        done already; the calls are still counted, so a forward that skips layers
        turns the pipeline off here as it would on a GPU."""
        if not self._step_loads:
            return
        i = self.index.get(name)
        if i is None:  # not a layer we registered: wait for everything, then stop pipelining
            self.disable(f"wait_for_layer_load({name!r}) names no registered KV layer")
            i = self.num_layers - 1
        if self._items:
            self._enqueue_until(i + (1 if self._after_layer_seen else LOOKAHEAD))
            if i > self._waited:
                torch.cuda.current_stream(self.device).wait_event(self._load_events[i])
        self._waited = max(self._waited, i)

    def after_layer(self, name: str) -> None:
        """``save_kv_layer``: this layer's compute is enqueued; enqueue the loads up to
        ``LOOKAHEAD`` layers further while the GPU runs it."""
        i = self.index.get(name)
        if i is None or not self._items:
            return
        self._after_layer_seen = True
        self._enqueue_until(i + LOOKAHEAD)

    def end_loads(self) -> None:
        """After the forward (``wait_for_save``) or before the next step: wait for the
        side stream and give the chunk buffers back."""
        if self._items:
            self._enqueue_until(self.num_layers - 1)
            self._items = []
            self._load_plan = None
            self._load_events[-1].synchronize()
            self._load_events = []
            self.layout.cache_indices(False)
        if self._step_loads and self._waited < self.num_layers - 1:
            self.disable(
                f"the forward pass waited for {self._waited + 1} of {self.num_layers} layers' loads "
                "(wait_for_layer_load was not called for every layer)"
            )
        self._step_loads = False
        bufs, self._load_bufs = self._load_bufs, []
        for b in bufs:
            b.release()

    # -- saves ------------------------------------------------------------------------
    def save_layer(self, name: str, plan: Callable[[], list[SaveItem]]) -> None:
        """``save_kv_layer``: gather this layer of every chunk this step saves.
        ``plan`` (called at the first layer of a step) allocates the chunk buffers."""
        i = self.index.get(name)
        if i is None:
            return
        if self._saves is None:
            self._saves = plan()
            if self._saves and self.stream is not None:
                self.layout.cache_indices(True)
            self._save_plan = self.layout.plan_layers(self._saves, False) if self._saves else None
        if not self._saves:
            return
        if self.stream is None:
            self.layout.run_layer(self._save_plan, i)
            for s in self._saves:
                s.layers.add(i)
            return
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.layout.run_layer(self._save_plan, i)
        for s in self._saves:
            s.layers.add(i)

    def end_saves(self) -> list[SaveItem]:
        """``wait_for_save``: the chunks gathered this step, every layer in place (a
        layer not handed over is gathered now). The caller stores and releases them."""
        saves, self._saves = self._saves or [], None
        if self.stream is not None:
            self.stream.synchronize()
            if saves:
                self.layout.cache_indices(False)
        self._save_plan = None  # after the side stream is done with its buffers
        late = 0
        for s in saves:
            for i in range(self.num_layers):
                if i not in s.layers:
                    self.layout.save_chunk(s.block_ids, s.lo, s.hi, s.buf.tensor, layer=i)
                    late += 1
        if late:
            self.layout.finish()
            self.late_save_layers += late
        self.pipelined_saves += len(saves)
        return saves

    def pending_saves(self) -> bool:
        return self._saves is not None

    def disable(self, why: str) -> None:
        if not self.disabled:
            log.warning("lmcache-core: layerwise transfers turned off: %s", why)
        self.disabled = True

    def close(self) -> None:
        """Finish whatever is in flight and give its buffers back."""
        self.end_loads()
        for s in self.end_saves():
            s.buf.release()
