"""Reading a run of chunks from the tiers in batches: what a load of many chunks costs
about one round trip per tier instead of one per chunk.

:func:`fetch_run` reads chunks ``0..n`` of a request in windows of at most
``window_bytes``: the memory tier (zero copy) is probed key by key, every other tier
is asked once per window for the chunks still missing (``get_many``; one round trip
on tiers that declare ``BATCHED``), fastest tier first, and what a slower tier served
is promoted as a single read would. While the caller copies one window into vLLM's
blocks, the next window is read on a helper thread, so a long load costs about one
round trip plus its bytes over the link. The run stops at the first chunk no tier
could provide (the rest is recomputed); nothing after it is read or kept.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Generator, Sequence

import torch

from . import metrics
from .backend import ZERO_COPY
from .keys import ChunkKey
from .memory import MemoryBuffer

if TYPE_CHECKING:
    from .engine import CacheEngine

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


def read_window(
    engine: "CacheEngine", keys: Sequence[ChunkKey], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype
) -> list[MemoryBuffer | None]:
    """Chunk ``keys[i]`` as a pool buffer (the caller owns one reference), or None
    where no tier holds it (or the pool is full)."""
    n = len(keys)
    got: list[MemoryBuffer | None] = [None] * n
    start = 0
    tier0 = engine.tiers[0] if engine.tiers else None
    if tier0 is not None and ZERO_COPY in tier0.capabilities and not engine._out(tier0):
        start = 1
        for i, key in enumerate(keys):
            got[i] = engine._tier0_buffer(tier0, key, shapes[i], dtype)
    missing = [i for i in range(n) if got[i] is None]
    if not missing:
        return got
    spare: dict[int, MemoryBuffer] = {}
    for i in missing:
        buf = engine.allocate(shapes[i], dtype)
        if buf is None:  # the pool is full: what follows is recomputed
            break
        spare[i] = buf
    missing = [i for i in missing if i in spare]
    level_of: dict[int, int] = {}
    try:
        for level, tier in enumerate(engine.tiers):
            if level < start or not missing or engine._out(tier):
                continue
            ks = [keys[i] for i in missing]
            outs = [spare[i].tensor for i in missing]
            t0 = time.perf_counter()
            try:
                ok = tier.get_many(ks, outs)
                if len(ok) != len(ks):
                    raise ValueError(f"get_many answered {len(ok)} results for {len(ks)} keys")
            except Exception as err:
                engine._tier_error(tier, "get", err)
                ok = [False] * len(ks)
            dt = time.perf_counter() - t0
            metrics.labeled(metrics.TIER_LATENCY, tier.name, "get").observe(dt)
            hit_bytes = sum(o.nbytes for o, h in zip(outs, ok) if h)
            if hit_bytes:
                engine.read_models[level].record(hit_bytes, dt)
                metrics.labeled(metrics.TIER_BYTES, tier.name, "get").inc(hit_bytes)
            still = []
            for i, hit in zip(missing, ok):
                if hit:
                    got[i] = spare.pop(i)
                    level_of[i] = level
                else:
                    still.append(i)
            missing = still
    finally:
        for buf in spare.values():
            buf.release()
    # Only the leading run is usable (keys chain: a chunk after a gap can never be
    # looked up without it); it is promoted, what follows the gap is dropped.
    lead = 0
    while lead < n and got[lead] is not None:
        lead += 1
    for i in range(lead, n):
        buf = got[i]
        if buf is not None:
            buf.release()
            got[i] = None
    for i in range(lead):
        level = level_of.get(i, 0)
        buf = got[i]
        if level > 0 and buf is not None:
            engine._promote(keys[i], buf, level)
    return got


def fetch_run(
    engine: "CacheEngine",
    hashes: Sequence[bytes],
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
    keys = [ChunkKey(engine._ns_id, h) for h in hashes]
    shapes_t = [tuple(s) for s in shapes]
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [item * int(torch.Size(s).numel()) for s in shapes_t]
    windows = _windows(sizes, window_bytes)

    def read(w: range) -> list[MemoryBuffer | None]:
        # Pool views made under an engine's inference mode are inference tensors: the
        # helper thread writes them in inference mode too.
        with torch.inference_mode():
            return read_window(engine, keys[w.start : w.stop], shapes_t[w.start : w.stop], dtype)

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
                engine.counters.add(retrieved_chunks=1)
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
