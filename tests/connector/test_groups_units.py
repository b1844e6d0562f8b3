"""KV-cache groups and the grouped layout adapter without an engine: vLLM's real spec
classes, tensors that overlay one storage the way vLLM's hybrid allocator lays them out."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from lmcache_connector.layouts.grouped_layout import NULL_BLOCK, GroupedLayout, page_view  # noqa: E402
from lmcache_connector.layouts.groups import (  # noqa: E402
    FULL,
    STATE,
    WINDOW,
    GroupInfo,
    GroupPlan,
    UnsupportedGroupError,
    boundary_hash,
    describe_groups,
    effective_chunk_size,
    STATE_SCHEDULER,
    state_advice,
)
from lmcache_connector.layouts.kv_adapters import LayoutError  # noqa: E402

BS = 16
HEADS, HEAD = 2, 8
NB = 64


def _attn(window: int | None = None):
    kw = dict(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    return SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)


def test_describe_groups_kinds_and_fingerprint():
    plan = describe_groups(_config(_attn(40), _attn()), default_block_size=BS)
    assert [g.kind for g in plan.groups] == [WINDOW, FULL]
    assert plan.groups[0].window == 40 and plan.hybrid and plan.has_boundary and not plan.has_state
    other = describe_groups(_config(_attn(48), _attn()), default_block_size=BS)
    assert plan.fingerprint() != other.fingerprint()  # another window: another namespace
    dense = describe_groups(_config(_attn()), default_block_size=BS)
    assert not dense.hybrid and not dense.has_boundary
    assert not describe_groups(None, default_block_size=128).hybrid


def test_describe_groups_rejects_unknown_kinds_clearly():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    spec = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, attention_chunk_size=64
    )
    with pytest.raises(UnsupportedGroupError, match="ChunkedLocalAttentionSpec.*supported are full attention"):
        describe_groups(_config(spec, _attn()), default_block_size=BS)
    # Alone it keeps the dense path of 0.1.0 (whole blocks): no model that ran stops.
    assert describe_groups(_config(spec), default_block_size=BS).groups[0].kind == FULL


def test_sliding_layers_folded_into_a_full_group_are_full():
    """Hybrid manager off: vLLM turns sliding layers into a full group that keeps every
    token (FullAttentionSpec with sliding_window set): stored like full attention."""
    folded = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, sliding_window=40)
    plan = describe_groups(_config(folded), default_block_size=BS)
    assert [g.kind for g in plan.groups] == [FULL] and not plan.hybrid


def test_effective_chunk_size_follows_block_size():
    plan = GroupPlan((GroupInfo(0, FULL, 384, ("a",)), GroupInfo(1, STATE, 384, ("b",), state_mode="align")))
    assert effective_chunk_size(256, plan) == 384
    assert effective_chunk_size(768, plan) == 768
    # A state group with one slot per request (mode none) puts no constraint on chunks.
    plan2 = GroupPlan((GroupInfo(0, FULL, 128, ("a",)), GroupInfo(1, STATE, 4096, ("b",), state_mode="none")))
    assert effective_chunk_size(256, plan2) == 256
    assert effective_chunk_size(200, plan2) == 256


def test_window_blocks_and_state_slot():
    w = GroupInfo(0, WINDOW, 16, ("a",), window=20)
    assert list(w.window_blocks(64)) == [2, 3]  # tokens 44..63
    assert list(w.window_blocks(48)) == [1, 2]  # tokens 28..47: one more than the window
    assert list(w.window_blocks(16)) == [0]
    s_align = GroupInfo(1, STATE, 16, ("b",), state_mode="align")
    s_none = GroupInfo(1, STATE, 4096, ("b",), state_mode="none")
    assert s_align.state_slot(64) == 3 and s_none.state_slot(64) == 0


def test_boundary_hash_is_distinct_and_stable():
    h = bytes(range(16))
    assert boundary_hash(h) == boundary_hash(h) and boundary_hash(h) != h and len(boundary_hash(h)) == 16


def _overlaid_caches():
    """Three layers over one storage (groups overlay each other in vLLM's pool): a
    window layer and a full layer as [NB, heads, BS, 2*head] views, a state layer as a
    (conv, ssm) pair of views with other dtypes, one page per block."""
    page = HEADS * BS * 2 * HEAD * 4
    store = torch.zeros(3 * NB * page, dtype=torch.uint8)

    def attn(layer: int) -> torch.Tensor:
        t = store[layer * NB * page : (layer + 1) * NB * page].view(torch.float32)
        return t.view(NB, HEADS, BS, 2 * HEAD)

    base = store[2 * NB * page : 3 * NB * page]
    conv = torch.as_strided(base.view(torch.bfloat16), (NB, 3, 8), (page // 2, 8, 1))
    f32 = base.view(torch.float32)
    ssm = torch.as_strided(f32, (NB, 2, 4), (page // 4, 4, 1), storage_offset=f32.storage_offset() + 48 // 4)
    caches = {"win": attn(0), "full": attn(1), "mamba": [conv, ssm]}
    plan = GroupPlan(
        (
            GroupInfo(0, WINDOW, BS, ("win",), window=20),
            GroupInfo(1, FULL, BS, ("full",)),
            GroupInfo(2, STATE, BS, ("mamba",), state_mode="align"),
        )
    )
    pages = {0: page, 1: page, 2: page}
    real = {0: page, 1: page, 2: 48 + 2 * 4 * 4}
    return store, caches, plan, pages, real


def test_page_view_covers_each_block_of_a_strided_state_layer():
    store, caches, plan, pages, real = _overlaid_caches()
    v = page_view(caches["mamba"], pages[2])
    caches["mamba"][1][5].fill_(3.0)
    assert v.shape == (NB, pages[2]) and v[5, 48:80].view(torch.float32).eq(3.0).all() and v[4].eq(0).all()
    with pytest.raises(LayoutError, match="does not hold"):
        page_view(caches["full"], pages[1] * 4)


def test_grouped_layout_round_trip_writes_only_its_blocks():
    torch.manual_seed(0)
    store, caches, plan, pages, real = _overlaid_caches()
    lay = GroupedLayout(caches, plan, pages, real)
    for t in (caches["win"], caches["full"], caches["mamba"][1]):
        t.copy_(torch.randn_like(t))
    # Request A: 4 blocks per attention group, its state for 64 tokens at slot 3.
    a = ([1, 2, 3, 4], [10, 11, 12, 13], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 20])
    chunk = torch.empty(lay.chunk_shape(64), dtype=torch.uint8)
    lay.save_chunk(a, 0, 64, chunk)
    bnd = torch.empty(lay.boundary_shape(64), dtype=torch.uint8)
    assert lay.save_boundary(a, 64, bnd)
    want_full = caches["full"][[10, 11, 12, 13]].clone()
    want_win = caches["win"][[3, 4]].clone()  # window 20 + 1 tokens before 64: blocks 2, 3
    want_state = caches["mamba"][1][20].clone()
    # Request B: vLLM allocated other blocks; its window table has nulls before the window.
    b = ([NULL_BLOCK, NULL_BLOCK, 30, 31], [40, 41, 42, 43], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 50])
    before = store.clone()
    lay.load_chunk(chunk, b, 0, 64, write_from=0)
    lay.load_boundary(bnd, b, 64, write_from=0)
    assert torch.equal(caches["full"][[40, 41, 42, 43]], want_full)
    assert torch.equal(caches["win"][[30, 31]], want_win)
    assert torch.equal(caches["mamba"][1][50], want_state)
    changed = (store != before).view(-1, pages[0]).any(dim=1).nonzero().flatten().tolist()
    # Only the destination pages changed (window, full, state layer regions).
    assert set(changed) <= {30, 31, NB + 40, NB + 41, NB + 42, NB + 43, 2 * NB + 50}
    assert caches["win"][NULL_BLOCK].eq(before.view(-1, pages[0])[NULL_BLOCK].view(torch.float32).view(HEADS, BS, 2 * HEAD)).all()


def test_grouped_layout_respects_write_from_and_freed_windows():
    store, caches, plan, pages, real = _overlaid_caches()
    lay = GroupedLayout(caches, plan, pages, real)
    caches["full"].copy_(torch.randn_like(caches["full"]))
    chunk = torch.empty(lay.chunk_shape(64), dtype=torch.uint8)
    lay.save_chunk(([1, 2, 3, 4], [10, 11, 12, 13], [0, 0, 0, 20]), 0, 64, chunk)
    shared = caches["full"][40].clone()
    # Tokens below 16 are vLLM's own prefix-cache block 40: never written.
    caches["full"][40].fill_(7.0)
    lay.load_chunk(chunk, ([0, 0, 30, 31], [40, 41, 42, 43], [0, 0, 0, 50]), 0, 64, write_from=16)
    assert caches["full"][40].eq(7.0).all() and not torch.equal(caches["full"][40], shared)
    assert torch.equal(caches["full"][41], caches["full"][11])
    # A window block already freed (null) or a missing state slot: nothing to save.
    out = torch.empty(lay.boundary_shape(64), dtype=torch.uint8)
    assert not lay.save_boundary(([1, 2, NULL_BLOCK, 4], [10, 11, 12, 13], [0, 0, 0, 20]), 64, out)
    assert not lay.save_boundary(([1, 2, 3, 4], [10, 11, 12, 13], [0, 0, 0, NULL_BLOCK]), 64, out)
    with pytest.raises(LayoutError, match="no state block"):
        lay.load_boundary(out, ([0, 0, 30, 31], [40, 41, 42, 43], [0, 0, 0, 0]), 64, 0)


def test_state_advice_names_the_state_scheduler_unless_it_is_in_use():
    full = GroupInfo(0, FULL, 128, ("a",))
    none = GroupPlan((full, GroupInfo(1, STATE, 4096, ("b", "c"), state_mode="none")))
    advice = state_advice(none, 256)
    assert advice is not None
    assert "2 state-space layer(s)" in advice and "prefix caching is off" in advice
    assert f"--scheduler-cls {STATE_SCHEDULER}" in advice and "every 256 tokens" in advice
    align = GroupPlan((full, GroupInfo(1, STATE, 128, ("b",), state_mode="align")))
    assert "'align' mamba cache mode" in (state_advice(align, 256) or "")
    # nothing to say once the state scheduler runs
    assert state_advice(none, 256, state_scheduler=True) is None
    assert state_advice(align, 256, state_scheduler=True) is None
    # negative controls: models without state layers get none
    assert state_advice(GroupPlan((full, GroupInfo(1, WINDOW, 128, ("b",), window=64))), 256) is None
    assert state_advice(GroupPlan((full,)), 256) is None
