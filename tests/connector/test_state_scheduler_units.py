"""Units of the state scheduler (lmcache_connector.state_scheduler): where a prefill
step of a state-space hybrid is cut, and when the scheduler has anything to align.
The scheduler inside real vLLM: tests/connector/test_e2e_hybrid.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from lmcache_connector.state_scheduler import (  # noqa: E402
    QUALNAME,
    StateBoundaryScheduler,
    check_split_hook,
    clip_to_boundary,
    is_state_scheduler,
    state_chunk_size,
    unexportable_checkpoint_block,
)


@pytest.mark.parametrize(
    "start, n, prefill_end, expect",
    [
        (0, 1500, 1500, 256),  # a one-step prefill stops at the first boundary
        (256, 1244, 1500, 256),  # and at each next one
        (1280, 220, 1500, 220),  # the last step ends at the prompt's end
        (100, 1000, 1500, 156),  # a start inside a chunk (after vLLM's own hit) realigns
        (0, 200, 1500, 200),  # a step that reaches no boundary is left alone
        (0, 256, 1500, 256),  # one that ends on it too
        (1500, 1, 1500, 1),  # decode steps are left alone
        (1600, 3, 1500, 3),
        (0, 0, 1500, 0),
    ],
)
def test_clip_to_boundary(start, n, prefill_end, expect):
    assert clip_to_boundary(start, n, prefill_end, 256) == expect


def test_clip_to_boundary_without_a_chunk_changes_nothing():
    assert clip_to_boundary(0, 1500, 1500, 0) == 1500


def test_state_chunk_size_only_for_our_connector_on_a_state_model():
    from lmcache_connector.connector import LMCacheCoreConnector

    def connector(sched: object) -> SimpleNamespace:
        """The connector's own answer, on a stand-in for its scheduler side."""
        fake = SimpleNamespace(_sched=sched)
        fake.lmcache_state_chunk_size = lambda: LMCacheCoreConnector.lmcache_state_chunk_size(fake)  # type: ignore[arg-type]
        return fake

    def side(has_state: bool | None, cs: int = 384) -> SimpleNamespace:
        return SimpleNamespace(cs=cs, plan=None if has_state is None else SimpleNamespace(has_state=has_state))

    assert state_chunk_size(connector(side(True))) == 384
    # negative controls: no state layers, a dense plan (None), the worker role (no
    # scheduler side), another connector, no connector
    assert state_chunk_size(connector(side(False))) == 0
    assert state_chunk_size(connector(side(None, 256))) == 0
    assert state_chunk_size(connector(None)) == 0
    assert state_chunk_size(SimpleNamespace(_sched=side(True))) == 0
    assert state_chunk_size(None) == 0


def test_a_vllm_without_the_split_hook_is_a_clear_error():
    from vllm.v1.core.sched.scheduler import Scheduler

    check_split_hook(Scheduler)  # the installed vLLM has it
    with pytest.raises(RuntimeError, match="remove --scheduler-cls " + QUALNAME.replace(".", r"\.")):
        check_split_hook(type("OtherScheduler", (), {}))


def test_is_state_scheduler_by_path_class_or_subclass():
    assert QUALNAME == "lmcache_connector.state_scheduler.StateBoundaryScheduler"
    assert is_state_scheduler(QUALNAME)
    assert is_state_scheduler(StateBoundaryScheduler)
    assert is_state_scheduler(type("Mine", (StateBoundaryScheduler,), {}))
    # negative controls: vLLM's own scheduler (path or default None), an unrelated class
    assert not is_state_scheduler("vllm.v1.core.sched.scheduler.Scheduler")
    assert not is_state_scheduler(None)
    assert not is_state_scheduler(int)


def test_steps_stay_within_a_block_only_for_mamba2_align_mode_on_cpu():
    """vLLM-CPU's Mamba2 kernel cannot export a state from inside a step: in "align"
    mode (prefix caching on) with a Mamba2 group (prefill checkpoint blocks), steps end
    on vLLM's blocks. Negative controls: another mode, no checkpoint blocks (gated
    delta-net, attention), not a CPU."""

    def groups(*checkpoint_blocks: int) -> SimpleNamespace:
        specs = [SimpleNamespace(num_prefill_checkpoint_blocks=n) for n in checkpoint_blocks]
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    align = SimpleNamespace(mamba_cache_mode="align", block_size=64)
    assert unexportable_checkpoint_block(groups(0, 1), align, on_cpu=True) == 64
    assert unexportable_checkpoint_block(groups(0, 1), align, on_cpu=False) == 0
    assert unexportable_checkpoint_block(groups(0, 0), align, on_cpu=True) == 0
    assert unexportable_checkpoint_block(groups(0, 1), SimpleNamespace(mamba_cache_mode="none", block_size=64), True) == 0
