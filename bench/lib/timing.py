"""Timing helpers: the median seconds of a call (on the CPU clock, or timed with
CUDA events), and a cold page cache."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable


def time_cpu(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds per call over ``rounds`` calls, after one warm-up call
    (first-touch page faults, lazy imports)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_cuda(fn: Callable[[], object], iters: int) -> float:
    """Median seconds per call, timed with CUDA events on the current stream."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Keep the GPU busy (~2 ms) while the host enqueues fn's work, so the events
        # time the GPU's work alone, not the host's enqueueing.
        torch.cuda._sleep(4_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache, dentries and inodes (root only);
    False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
