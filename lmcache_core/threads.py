"""Priorities of lmcache-core's background threads (loads and prefetches off vLLM's
forward path, read-ahead, write-behind, asynchronous saves, the pool's populate).

On a host whose cores run the model, a background transfer takes CPU from the
forward pass of every other request: receiving, checking and copying a long prefix
from a network tier shares the cores the decode steps run on. ``background_nice``
lowers those threads' priority (Linux sets a nice value per thread), so the kernel
gives the model's threads the cores first and the transfer the rest; the load
itself then takes longer whenever the cores are busy.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (at most to 19). A no-op
    for ``nice <= 0``, and where the platform has no per-thread priorities or
    refuses (logged once per thread at debug level)."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as err:
        log.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, err)


def idle_priority() -> None:
    """Run the calling thread only when a core is otherwise idle (Linux
    ``SCHED_IDLE``), so background work never takes a core from the engine's
    threads; elsewhere, or where refused, it keeps its priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
