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

With ``connector.save_decode_cache: prefill`` it also runs the connector's *settles*
(:mod:`lmcache_connector.features.settle`): when a request finishes, an internal
request prefills the whole chunks of its answer once more, so that the next turn of a
chat hits them with exactly what a recomputation gives. Their outputs never leave this
scheduler. This works for any model, with or without state-space layers.

It subclasses vLLM's synchronous ``Scheduler`` (vLLM-CPU runs without asynchronous
scheduling), so where vLLM would schedule asynchronously it runs synchronously; vLLM
logs a warning for any custom scheduler class. It relies on vLLM 0.32's mamba split
hook (``need_mamba_block_aligned_split`` / ``_mamba_block_aligned_split``).

On vLLM-CPU with a Mamba2 model and prefix caching on ("align" mode), steps end on
vLLM's block boundaries instead (:func:`unexportable_checkpoint_block`): vLLM-CPU's
Mamba2 kernel cannot export a state from inside a step, and a step spanning more
than one block past its start makes it try (``IndexError`` in
``mamba_mixer2.conv_ssm_forward``). Every chunk boundary is a block boundary, so
every whole chunk's state still exists; the cost is more, shorter steps.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

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


def unexportable_checkpoint_block(kv_cache_config: Any, cache_config: Any, on_cpu: bool) -> int:
    """vLLM's block size when its prefill steps must each stay within one block, else 0.

    In "align" mode a Mamba2 layer (a ``MambaSpec`` with prefill checkpoint blocks)
    exports the state at the last block boundary before a step's end from inside
    the step whenever the step reaches two blocks past its start
    (``is_mamba_prefill_checkpoint_valid``). vLLM-CPU 0.32's Mamba2 kernel returns
    only each request's final state, not the per-chunk states that export reads:
    ``IndexError: index 1 is out of bounds for dimension 0 with size 1`` in
    ``mamba_mixer2.conv_ssm_forward``, with or without the connector. A step from a
    block boundary to at most the next one never exports (and so never crashes).
    Where the block size is the chunk size, the chunk-boundary steps already are
    such steps; where it is smaller (an AVX2-only CPU: the test's Granite model),
    0.32 crashes without this."""
    if not on_cpu or getattr(cache_config, "mamba_cache_mode", None) != "align":
        return 0
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not any(int(getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) or 0) > 0 for g in groups):
        return 0
    return int(cache_config.block_size)


def check_split_hook(scheduler_cls: type) -> None:
    """Raise a clear error when ``scheduler_cls`` (vLLM's scheduler) lacks the mamba
    split hook this scheduler extends: without it the flag would silently do nothing."""
    if not callable(getattr(scheduler_cls, "_mamba_block_aligned_split", None)):
        raise RuntimeError(
            f"{QUALNAME} extends vLLM's Scheduler._mamba_block_aligned_split, which this vLLM does not have "
            f"(tested with vLLM 0.32): remove --scheduler-cls {QUALNAME}"
        )


#: settle ids remembered to drop their outputs (a settle's last output can come one
#: step after it left the scheduler: vLLM's finished-request sets)
SETTLE_IDS_KEPT = 4096


def settle_request(plan: Any) -> Request:
    """The vLLM request a settle plan (features.settle.SettlePlan) runs: its tokens,
    one greedy token to sample, and everything of the finished request that goes into
    the chunk keys (cache options, salt, LoRA) or the queue (priority, client)."""
    src = plan.source
    req = Request(
        request_id=plan.req_id,
        prompt_token_ids=list(plan.tokens),
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
        pooling_params=None,
        client_index=int(getattr(src, "client_index", 0)),
        lora_request=getattr(src, "lora_request", None),
        cache_salt=getattr(src, "cache_salt", None),
        priority=int(getattr(src, "priority", 0)),
        block_hasher=getattr(src, "_block_hasher", None),
    )
    params = getattr(src, "kv_transfer_params", None)
    req.kv_transfer_params = dict(params) if params else None
    return req


def drop_outputs(outputs: dict[int, Any], ids: "OrderedDict[str, None]") -> None:
    """Remove the outputs (and finished-request entries) of the requests ``ids`` from
    vLLM's per-client ``EngineCoreOutputs``."""
    for eco in outputs.values():
        if eco.outputs:
            eco.outputs = [o for o in eco.outputs if o.request_id not in ids]
        finished = getattr(eco, "finished_requests", None)
        if finished:
            eco.finished_requests = {r for r in finished if r not in ids}


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
        self._lmc_step = self._lmc_chunk
        if self._lmc_chunk:
            from vllm.platforms import current_platform  # noqa: PLC0415

            block = unexportable_checkpoint_block(self.kv_cache_config, self.cache_config, current_platform.is_cpu())
            if block and self._lmc_chunk % block == 0 and block < self._lmc_chunk:
                self._lmc_step = block
                log.info(
                    "lmcache-core: vLLM-CPU cannot export a Mamba2 state from inside a step in 'align' mode: "
                    "prefill steps end on its %d-token blocks",
                    block,
                )
            # vLLM calls the split hook below only when this is set
            self.need_mamba_block_aligned_split = True
            log.info(
                "lmcache-core: prefill steps end on %d-token chunk boundaries, so every whole chunk's recurrent state is stored",
                self._lmc_chunk,
            )
        else:
            log.info("lmcache-core: %s has nothing to align here (no state-space layers or no lmcache-core connector)", QUALNAME)
        self._lmc_settle_ids: OrderedDict[str, None] = OrderedDict()

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._lmc_settle_ids:
            drop_outputs(outputs, self._lmc_settle_ids)
        self._add_settles()
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[Any]:
        """vLLM's abort (a client went away): the engine may be idle now, which is
        when ``settle_when: idle`` settles run. (None, every request: a shutdown or
        a pause, when none is added.)"""
        finished = super().finish_requests(request_ids, finished_status)
        if request_ids is not None:
            self._add_settles()
        return finished

    def _add_settles(self) -> None:
        """Queue the settles the connector planned as requests finished this step."""
        take = getattr(self.connector, "lmcache_take_settles", None)
        dropped = getattr(self.connector, "lmcache_settle_dropped", None)
        if not callable(take) or not callable(dropped):
            return
        running, waiting = self.get_request_counts()
        for plan in take(idle=running + waiting == 0, budget=self.max_num_scheduled_tokens):
            try:
                req = settle_request(plan)
            except (TypeError, ValueError, AttributeError) as err:  # vLLM refused it: the answer is simply not stored
                log.warning("lmcache-core: settle %s not queued (%s); its answer is not stored", plan.req_id, err)
                dropped(plan.req_id)
                continue
            self._lmc_settle_ids[plan.req_id] = None
            while len(self._lmc_settle_ids) > SETTLE_IDS_KEPT:
                self._lmc_settle_ids.popitem(last=False)
            self.add_request(req)

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
        return clip_to_boundary(start, num_new_tokens, request.num_prompt_tokens, self._lmc_step)
