"""vLLM-CPU's core reservation, and what a KV connector does to it.

vLLM's CPU build binds each worker's OpenMP threads to cores and reserves some for the
other processes (the API server, the engine core's scheduler): one per rank, plus one
more per rank whenever a ``--kv-transfer-config`` is given (meant for NIXL's transfer
threads; ``vllm/utils/ompmultiprocessing.py``). lmcache-core needs no core of its own,
so that second reservation only takes a core from the model: on a 2-core host with one
rank, vLLM then reserves both cores, gives up reserving any (it warns that the worker's
cores are not more than the reserved ones) and the API server and the engine core
compete with the worker's threads (measured: first tokens 2.2x and decoding 2.5x slower
than vLLM alone). ``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides the count.
"""

from __future__ import annotations

import os
from typing import Any

from lmcache_core.threads import spare_cores

ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def reservation_advice(vllm_config: Any, env: dict[str, str] | None = None, cores: int | None = None) -> str | None:
    """A warning for the start-up log when the connector makes vLLM-CPU reserve a core
    the model could use; None when nothing is to be said (a GPU platform, or the
    reservation is set explicitly)."""
    env = dict(os.environ) if env is None else env
    if ENV in env:
        return None
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
    except Exception:  # no platform to ask: say nothing rather than guess
        return None
    world = int(getattr(vllm_config.parallel_config, "local_world_size", 0) or vllm_config.parallel_config.world_size)
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    reserved = 2 * world
    if cores <= reserved:
        return (
            f"vLLM-CPU reserves {reserved} of this host's {cores} cores because a KV connector is configured (one "
            f"more per rank than without one, meant for NIXL): with no core left for the model it reserves none, and "
            f"the API server and engine core compete with the model's threads. lmcache-core needs no core of its "
            f"own: set {ENV}={world} (what vLLM reserves without a connector)"
        )
    return (
        f"vLLM-CPU reserves {reserved} of this host's {cores} cores because a KV connector is configured (one more "
        f"per rank than without one, meant for NIXL), leaving the model {cores - reserved}. lmcache-core needs no "
        f"core of its own: set {ENV}={world} to give the model that core back"
    )


def background_cores(world_size: int, cpu_platform: bool | None = None) -> frozenset[int] | None:
    """Where lmcache-core's background threads go on vLLM-CPU (``background_cores:
    auto``): the cores this worker's model threads are not bound to. Called on the
    worker's main thread once vLLM-CPU has bound it (OpenMP binds the thread that runs
    the model to the worker's first core, and every thread that thread starts inherits
    that binding). None on a GPU platform, with several ranks (each binds its own cores
    and the others' are not known here), or when the model is not bound to a part of
    the cores."""
    if world_size != 1 or not hasattr(os, "sched_getaffinity"):
        return None
    if cpu_platform is None:
        try:
            from vllm.platforms import current_platform

            cpu_platform = current_platform.is_cpu()
        except Exception:  # no platform to ask: leave the threads where they start
            return None
    if not cpu_platform:
        return None
    model = os.sched_getaffinity(0)
    try:
        machine = os.sched_getaffinity(os.getppid())  # the engine core: never bound by vLLM
    except OSError:
        machine = set(range(os.cpu_count() or 1))
    return spare_cores(machine, model)


def auto_async_saves(vllm_config: Any, cpu_platform: bool | None = None, multiprocess: bool | None = None) -> bool:
    """What ``connector.async_saves: auto`` means for this engine: background saves on
    vLLM-CPU's server shape (the engine core in its own process, as ``vllm serve`` and
    the OpenAI server run it, and one rank per host): vLLM-CPU then leaves a core to the
    API server and the engine core, and the saves' copies run there (measured on the
    OpenAI server: doc QA 1.13x output and 0.85x TTFT p50 of saving in the step; no
    reuse 0.966x of vLLM alone's throughput against 0.903x). In the step elsewhere: on
    GPUs a step's saves are DMAs finished in the step; with the engine in process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, offline batches) a later ``generate`` then
    always finds what an earlier one stored; with several ranks no core is left over.
    Both connector roles call this with the same vLLM config."""
    if cpu_platform is None:
        try:
            from vllm.platforms import current_platform

            cpu_platform = current_platform.is_cpu()
        except Exception:  # no platform to ask: keep saves in the step
            return False
    if multiprocess is None:
        try:
            import vllm.envs as envs

            multiprocess = bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
        except Exception:
            return False
    world = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
    return bool(cpu_platform and multiprocess and world == 1)
