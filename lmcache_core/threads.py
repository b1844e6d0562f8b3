"""Priorities of lmcache-core's background threads (loads and prefetches off vLLM's
forward path, read-ahead, write-behind, asynchronous saves, the pool's populate).

On a host whose cores run the model, a background transfer takes CPU from the
forward pass of every other request: receiving, checking and copying a long prefix
from a network tier shares the cores the decode steps run on. ``background_nice``
lowers those threads' priority (Linux sets a nice value per thread), so the kernel
gives the model's threads the cores first and the transfer the rest; the load
itself then takes longer whenever the cores are busy.

Where the model's threads are bound to some of the host's cores (vLLM-CPU binds each
worker's OpenMP threads and leaves the rest to the API server and the engine core),
``background_cores: auto`` moves the background threads to cores the model does not run
on: a thread started by the model's main thread otherwise inherits its binding and
takes turns with the forward pass on the model's own core.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

_cores: frozenset[int] | None = None  # where background threads run; None: where they start


def use_background_cores(cores: "set[int] | frozenset[int] | list[int] | None") -> None:
    """Run the background threads started from now on on ``cores`` (None: leave them
    on the cores of the thread that starts them). Process-wide: the binding belongs to
    the process's threads, whichever engine starts them."""
    global _cores
    _cores = frozenset(cores) if cores else None


def spare_cores(machine: "set[int]", model: "set[int]") -> frozenset[int] | None:
    """The cores of ``machine`` the model's threads are not bound to, when the model is
    bound to a part of them (vLLM-CPU's OpenMP binding); None when it is not bound, or
    bound to every core (nothing to move to)."""
    spare = frozenset(machine) - frozenset(model)
    if not model or not spare or not frozenset(model) <= frozenset(machine):
        return None
    return spare


def enter_background(nice: int = 0, cores: "frozenset[int] | None" = None) -> None:
    """What every background thread calls first: its nice value raised by ``nice``
    (:func:`lower_priority`) and its cores: ``cores`` when given, else the background
    cores when set (:func:`use_background_cores`). Refusals are logged at debug level,
    never raised."""
    lower_priority(nice)
    _bind_to_background_cores(cores)


def _bind_to_background_cores(cores: "frozenset[int] | None" = None) -> None:
    cores = cores or _cores
    if cores is None:
        return
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError, ValueError) as err:
        log.debug("could not move thread %s to cores %s: %s", threading.current_thread().name, sorted(cores), err)


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
    threads; elsewhere, or where refused, it keeps its priority. It also moves to the
    background cores when they are set."""
    _bind_to_background_cores()
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
