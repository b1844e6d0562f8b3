"""vLLM's scheduler with every prefill step of a state-space hybrid ending on a chunk
boundary, so that the recurrent state after every whole chunk of a prompt exists and
is stored.

A Mamba / gated delta-net layer keeps one running state per request: the state after
``E`` tokens exists only when a scheduler step ends at ``E``. vLLM prefills a prompt
shorter than ``max_num_batched_tokens`` in one step, so without help only the state
at the prompt's end exists, and a later request that shares a shorter part of the
prompt finds no state at its own chunk boundary: no hit. This scheduler ends each
prefill step of such a model at the next chunk boundary past its start (the prompt's
last step still ends at the prompt's end), and the connector stores the state at
each one.

Use it with ``--scheduler-cls lmcache_connector.state_scheduler.StateBoundaryScheduler``
(``scheduler_cls=`` in Python). It changes nothing for models without state-space
layers, for decode steps, or without lmcache-core's connector. With vLLM's prefix
caching on ("align" mamba cache mode) vLLM's own split runs first and this one only
adds stops. The cost is more, shorter steps per prompt: measured by
``bench/bench_hybrid.py``, figures in docs/benchmarks.md.

It subclasses vLLM's synchronous ``Scheduler`` (vLLM-CPU runs without asynchronous
scheduling), so where vLLM would schedule asynchronously it runs synchronously; vLLM
logs a warning for any custom scheduler class. It relies on vLLM 0.32's mamba split
hook (``need_mamba_block_aligned_split`` / ``_mamba_block_aligned_split``).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from .layouts.groups import STATE_SCHEDULER as QUALNAME  # the dotted path users give vLLM (--scheduler-cls)

log = logging.getLogger("vllm.lmcache.state_scheduler")


def state_chunk_size(connector: Any) -> int:
    """lmcache-core's chunk size when ``connector`` is its connector serving a model
    with state-space layers, else 0 (nothing to align)."""
    ask = getattr(connector, "lmcache_state_chunk_size", None)
    return int(ask()) if callable(ask) else 0


def clip_to_boundary(start: int, num_new_tokens: int, prefill_end: int, chunk: int) -> int:
    """``num_new_tokens`` cut so that a prefill step from ``start`` stops at the first
    multiple of ``chunk`` strictly inside it; steps at or past ``prefill_end``
    (decode) are left alone."""
    if chunk <= 0 or start >= prefill_end or num_new_tokens <= 0:
        return num_new_tokens
    boundary = (start // chunk + 1) * chunk
    return min(num_new_tokens, boundary - start)


def check_split_hook(scheduler_cls: type) -> None:
    """Raise a clear error when ``scheduler_cls`` (vLLM's scheduler) lacks the mamba
    split hook this scheduler extends: without it the flag would silently do nothing."""
    if not callable(getattr(scheduler_cls, "_mamba_block_aligned_split", None)):
        raise RuntimeError(
            f"{QUALNAME} extends vLLM's Scheduler._mamba_block_aligned_split, which this vLLM does not have "
            f"(tested with vLLM 0.32): remove --scheduler-cls {QUALNAME}"
        )


def is_state_scheduler(scheduler_cls: Any) -> bool:
    """Whether vLLM's configured scheduler class (``scheduler_config.scheduler_cls``,
    a dotted path or a class) is this module's scheduler or a subclass of it."""
    if isinstance(scheduler_cls, str):
        return scheduler_cls == QUALNAME
    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, StateBoundaryScheduler)


class StateBoundaryScheduler(Scheduler):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_split_hook(Scheduler)
        super().__init__(*args, **kwargs)
        self._lmc_chunk = state_chunk_size(getattr(self, "connector", None))
        self._vllm_splits = bool(self.need_mamba_block_aligned_split)
        if self._lmc_chunk:
            # vLLM calls the split hook below only when this is set
            self.need_mamba_block_aligned_split = True
            log.info(
                "lmcache-core: prefill steps end on %d-token chunk boundaries, so every whole chunk's recurrent state is stored",
                self._lmc_chunk,
            )
        else:
            log.info("lmcache-core: %s has nothing to align here (no state-space layers or no lmcache-core connector)", QUALNAME)

    def _mamba_block_aligned_split(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if self._vllm_splits:
            num_new_tokens = super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
            )
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        return clip_to_boundary(start, num_new_tokens, request.num_prompt_tokens, self._lmc_chunk)
