"""Transfers on a side CUDA stream, ordered against the compute stream with events.

Saving: ``save_async`` enqueues the gather on the side stream after everything
already queued on the caller's current stream (the attention that wrote the KV), so
it overlaps the rest of the forward pass; the returned event completes when the bytes
are in the destination buffer (host memory included).

Loading: ``load_layer_async`` enqueues one layer's scatter; before computing that
layer the connector calls ``wait(event)`` (``wait_for_layer_load``), which makes the
compute stream wait on the GPU without blocking the host. ``load_async`` loads all
layers in one launch.

On CPU (or with CPU KV tensors) the same API runs synchronously and returns events
that are already complete, so callers need no second code path.

The caller keeps the buffers it passes (e.g. a pool's pinned buffer) alive and
unreused until the event completes; the event also holds references to the tensors
it was given, so dropping them early cannot free device memory under the copy.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from lmcache_cuda import ops

Granularity = Literal["tokens", "blocks"]


class TransferEvent:
    """Completion of one enqueued transfer."""

    __slots__ = ("_event", "_device", "_keepalive")

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        device: torch.device | None = None,
        keepalive: tuple = (),
    ) -> None:
        self._event = event
        self._device = device
        self._keepalive = keepalive

    @property
    def cuda_event(self) -> torch.cuda.Event | None:
        """The underlying CUDA event; None for a transfer that ran synchronously."""
        return self._event

    def query(self) -> bool:
        """True once the transfer has finished."""
        done = self._event is None or self._event.query()
        if done:
            self._keepalive = ()
        return done

    def synchronize(self) -> None:
        """Block the host until the transfer has finished."""
        if self._event is not None:
            self._event.synchronize()
        self._keepalive = ()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait on the GPU; the host goes on."""
        if self._event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        stream.wait_event(self._event)


class TransferStream:
    """A side stream for KV saves and loads.

    ``device``: the KV cache's device; ``None`` picks the current CUDA device when
    CUDA is available, else CPU (synchronous mode). ``priority``: CUDA stream priority
    (lower is higher priority), e.g. to let layer loads overtake saves.
    """

    def __init__(self, device: torch.device | str | int | None = None, *, priority: int = 0) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=device, priority=priority) if device.type == "cuda" else None
        )

    def save_async(
        self,
        kv_caches: Sequence[torch.Tensor],
        index: torch.Tensor,
        out: torch.Tensor,
        *,
        granularity: Granularity = "tokens",
    ) -> TransferEvent:
        """Gather ``index`` (slots or block ids) of every layer into ``out``."""
        fn = ops.gather_tokens if granularity == "tokens" else _blocks(granularity, ops.gather_blocks)
        return self._run(fn, kv_caches, index, out)

    def load_async(
        self,
        kv_caches: Sequence[torch.Tensor],
        index: torch.Tensor,
        src: torch.Tensor,
        *,
        granularity: Granularity = "tokens",
    ) -> TransferEvent:
        """Scatter ``src`` into every layer at ``index`` in one launch."""
        fn = ops.scatter_tokens if granularity == "tokens" else _blocks(granularity, ops.scatter_blocks)
        return self._run(fn, kv_caches, index, src)

    def load_layer_async(
        self,
        layer: int,
        kv_caches: Sequence[torch.Tensor],
        index: torch.Tensor,
        src: torch.Tensor,
        *,
        granularity: Granularity = "tokens",
    ) -> TransferEvent:
        """Scatter layer ``layer`` of ``src`` (``src[layer]``) into ``kv_caches[layer]``."""
        if not 0 <= layer < len(kv_caches):
            raise IndexError(f"layer {layer} out of range for {len(kv_caches)} layers")
        if src.dim() < 1 or src.shape[0] != len(kv_caches):
            raise ValueError(f"src has shape {tuple(src.shape)}; its first dim must be the {len(kv_caches)} layers")
        fn = ops.scatter_tokens if granularity == "tokens" else _blocks(granularity, ops.scatter_blocks)
        return self._run(fn, [kv_caches[layer]], index, src[layer : layer + 1])

    def wait(self, event: TransferEvent, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for ``event`` on the GPU; the host goes on."""
        event.wait(stream)

    def synchronize(self) -> None:
        """Block the host until everything enqueued on the side stream has finished."""
        if self.stream is not None:
            self.stream.synchronize()

    def _run(self, fn, kv_caches: Sequence[torch.Tensor], index: torch.Tensor, buf: torch.Tensor) -> TransferEvent:
        if self.stream is None or not kv_caches[0].is_cuda:
            fn(kv_caches, index, buf)
            return TransferEvent(None)
        if kv_caches[0].device != self.device:
            raise ValueError(f"KV tensors are on {kv_caches[0].device}, this stream on {self.device}")
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for t in (index, buf):
                if t.is_cuda:
                    t.record_stream(self.stream)
            fn(kv_caches, index, buf)
            done = self.stream.record_event()
        return TransferEvent(done, self.device, (tuple(kv_caches), index, buf))


def _blocks(granularity: str, fn):
    if granularity != "blocks":
        raise ValueError(f"granularity={granularity!r}: use 'tokens' or 'blocks'")
    return fn
