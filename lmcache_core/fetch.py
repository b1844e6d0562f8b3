"""Reading a run of chunks from the tiers in batches: what a load of many chunks costs
about one round trip per tier instead of one per chunk.

:func:`fetch_run` reads chunks ``0..n`` of a request in windows of at most
``window_bytes``, each window through the stack's one read path
(:meth:`~lmcache_core.tiers.TierStack.read`): the memory tier (zero copy) is probed
key by key, every other tier is asked once per window for the chunks still missing
(``get_many``; one round trip on tiers that declare ``BATCHED``), fastest tier first,
and what a slower tier served is promoted. While the caller copies one window into vLLM's
blocks, the next window is read on a helper thread, so a long load costs about one
round trip plus its bytes over the link. The run stops at the first chunk no tier
could provide (the rest is recomputed); nothing after it is read or kept.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generator, Sequence

import torch

from .keys import ChunkKey
from .memory import MemoryBuffer
from .tiers import TierStack

#: bytes of chunks one window asks the slower tiers for (and holds in the pool)
WINDOW_BYTES = 64 << 20


def _windows(sizes: Sequence[int], window_bytes: int) -> list[range]:
    out: list[range] = []
    start = total = 0
    for i, n in enumerate(sizes):
        if i > start and total + n > window_bytes:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def fetch_run(
    stack: TierStack,
    keys: Sequence[ChunkKey],
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    *,
    window_bytes: int = WINDOW_BYTES,
    pool: ThreadPoolExecutor | None = None,
) -> Generator[MemoryBuffer, None, None]:
    """Yield chunk ``i``'s buffer for ``i = 0, 1, ...`` until the first chunk no tier
    holds; the caller releases each buffer it gets. With ``pool``, window ``k + 1`` is
    read while the caller uses window ``k``. Closing the generator early releases what
    it holds."""
    shapes_t = [tuple(s) for s in shapes]
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [item * int(torch.Size(s).numel()) for s in shapes_t]
    windows = _windows(sizes, window_bytes)

    def read(w: range) -> list[MemoryBuffer | None]:
        # Pool views made under an engine's inference mode are inference tensors: the
        # helper thread writes them in inference mode too.
        with torch.inference_mode():
            return stack.read(keys[w.start : w.stop], shapes_t[w.start : w.stop], dtype)

    pending: Future[list[MemoryBuffer | None]] | None = None
    current: list[MemoryBuffer | None] = []
    yielded = 0
    try:
        for k, w in enumerate(windows):
            current = pending.result() if pending is not None else read(w)
            pending = None
            complete = all(b is not None for b in current)
            if complete and pool is not None and k + 1 < len(windows):
                pending = pool.submit(read, windows[k + 1])
            for j, buf in enumerate(current):
                if buf is None:
                    return
                current[j] = None  # handed over: the caller releases it
                yielded += 1
                stack.counters.add(retrieved_chunks=1)
                yield buf
            if not complete:
                return
    finally:
        for buf in current:
            if buf is not None:
                buf.release()
        if pending is not None:
            for buf in pending.result():
                if buf is not None:
                    buf.release()
