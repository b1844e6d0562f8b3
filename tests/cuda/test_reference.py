"""The pure-torch reference path, on CPU: gathers match vLLM's layout definition,
scatters restore the cache, blocks move whole, for the block size / head size / dtype
matrix."""

from __future__ import annotations

import pytest
import torch

from lmcache_cuda import PagedLayout, reference
from lmcache_cuda.paged_layout import int_view
from lmcache_cuda.testing import (
    DTYPES,
    bits_equal,
    expected_blocks,
    expected_gather,
    ragged_slots,
    random_paged_kv,
)

LAYERS, HEADS, BLOCKS = 3, 2, 5
MATRIX = [pytest.param(b, d, name, id=f"B{b}-D{d}-{name}") for b in (16, 32, 128) for d in (64, 128) for name in DTYPES]


def _kv(block_size: int, head_size: int, dtype_name: str, *, permuted: bool = False, seed: int = 0):
    return random_paged_kv(LAYERS, BLOCKS, HEADS, block_size, head_size, DTYPES[dtype_name], permuted=permuted, seed=seed)


def _token_buf(kv, n: int) -> torch.Tensor:
    layout = PagedLayout.from_layers(kv)
    return torch.empty(layout.token_buffer_shape(n), dtype=layout.dtype)


@pytest.mark.parametrize("block_size,head_size,dtype_name", MATRIX)
@pytest.mark.parametrize("permuted", [False, True], ids=["contig", "permuted"])
def test_gather_matches_layout_definition(block_size, head_size, dtype_name, permuted):
    kv = _kv(block_size, head_size, dtype_name, permuted=permuted)
    num_tokens = 2 * block_size + block_size // 2 + 3  # ragged: a partial last block
    slots = ragged_slots(BLOCKS, block_size, num_tokens, pad=3, seed=1)
    out = _token_buf(kv, slots.numel())
    assert reference.gather_tokens(kv, slots, out) is out
    assert bits_equal(out, expected_gather(kv, slots))
    assert torch.count_nonzero(out.view(torch.uint8)[:, :, num_tokens:]) == 0  # padding -> zeros


@pytest.mark.parametrize("block_size,head_size,dtype_name", MATRIX)
@pytest.mark.parametrize("permuted", [False, True], ids=["contig", "permuted"])
def test_gather_then_scatter_restores_cache(block_size, head_size, dtype_name, permuted):
    kv = _kv(block_size, head_size, dtype_name, permuted=permuted)
    original = [t.clone() for t in kv]
    slots = ragged_slots(BLOCKS, block_size, 3 * block_size - 5, pad=2, seed=2)
    buf = reference.gather_tokens(kv, slots, _token_buf(kv, slots.numel()))
    valid = slots[slots >= 0]
    for t in kv:  # wipe exactly the gathered tokens
        int_view(t).transpose(1, 2)[valid // block_size, valid % block_size] = 0
    assert not all(bits_equal(a, b) for a, b in zip(kv, original))
    reference.scatter_tokens(kv, slots, buf)
    for a, b in zip(kv, original):
        assert bits_equal(a, b)


@pytest.mark.parametrize("block_size,head_size,dtype_name", MATRIX)
def test_scatter_touches_only_its_slots(block_size, head_size, dtype_name):
    src_kv = _kv(block_size, head_size, dtype_name, seed=3)
    slots = ragged_slots(BLOCKS, block_size, block_size + 7, pad=1, seed=4)
    buf = reference.gather_tokens(src_kv, slots, _token_buf(src_kv, slots.numel()))
    dst_kv = [torch.zeros_like(t) for t in src_kv]
    reference.scatter_tokens(dst_kv, slots, buf)
    assert bits_equal(reference.gather_tokens(dst_kv, slots, _token_buf(dst_kv, slots.numel())), buf)
    written = sum(int(torch.count_nonzero(int_view(t))) for t in dst_kv)
    touched = LAYERS * (block_size + 7) * HEADS * 2 * head_size  # elements
    assert 0 < written <= touched


@pytest.mark.parametrize("block_size,head_size,dtype_name", MATRIX)
@pytest.mark.parametrize("permuted", [False, True], ids=["contig", "permuted"])
def test_blocks_round_trip(block_size, head_size, dtype_name, permuted):
    kv = _kv(block_size, head_size, dtype_name, permuted=permuted, seed=5)
    ids = torch.tensor([3, 0, -1, 4])
    layout = PagedLayout.from_layers(kv)
    out = torch.empty((LAYERS, ids.numel(), layout.block_numel), dtype=layout.dtype)
    reference.gather_blocks(kv, ids, out)
    assert bits_equal(out, expected_blocks(kv, ids))
    if not permuted:  # the block adapter's definition: kv_layer[block_ids]
        for layer, t in enumerate(kv):
            assert bits_equal(out[layer, [0, 1, 3]].view(3, *t.shape[1:]), t[[3, 0, 4]])
    dst = [torch.zeros_like(t) for t in kv]
    reference.scatter_blocks(dst, ids, out)
    for a, b in zip(dst, kv):
        for blk in range(BLOCKS):
            assert bits_equal(a[blk], b[blk] if blk in (0, 3, 4) else torch.zeros_like(b[blk]))


def test_block_buffer_may_keep_the_block_shape():
    kv = _kv(16, 64, "fp16")
    ids = torch.tensor([1, 2], dtype=torch.int32)
    out = torch.empty((LAYERS, 2, *kv[0].shape[1:]), dtype=torch.float16)
    reference.gather_blocks(kv, ids, out)
    for layer, t in enumerate(kv):
        assert bits_equal(out[layer], t[[1, 2]])


def test_int32_slots_and_empty_mapping():
    kv = _kv(16, 64, "bf16")
    slots = torch.tensor([5, 17, 40], dtype=torch.int32)
    out = _token_buf(kv, 3)
    reference.gather_tokens(kv, slots, out)
    assert bits_equal(out, expected_gather(kv, slots.long()))
    empty = torch.empty(0, dtype=torch.int64)
    assert reference.gather_tokens(kv, empty, _token_buf(kv, 0)).numel() == 0
    reference.scatter_tokens(kv, empty, _token_buf(kv, 0))


def test_out_of_range_slots_and_ids_are_skipped():
    kv = _kv(16, 64, "fp32")
    before = [t.clone() for t in kv]
    slots = torch.tensor([BLOCKS * 16, -1, 3])
    out = reference.gather_tokens(kv, slots, _token_buf(kv, 3))
    assert torch.count_nonzero(out[:, :, :2]) == 0
    reference.scatter_tokens(kv, slots, out)
    assert all(bits_equal(a, b) for a, b in zip(kv, before))
    layout = PagedLayout.from_layers(kv)
    bout = torch.empty((LAYERS, 1, layout.block_numel), dtype=torch.float32)
    reference.gather_blocks(kv, torch.tensor([BLOCKS]), bout)
    assert torch.count_nonzero(bout) == 0
    reference.scatter_blocks(kv, torch.tensor([BLOCKS]), bout)
    assert all(bits_equal(a, b) for a, b in zip(kv, before))


def test_layout_from_layers():
    kv = _kv(32, 128, "fp16", permuted=True)
    layout = PagedLayout.from_layers(kv)
    assert (layout.num_layers, layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.head_size) == (
        LAYERS,
        BLOCKS,
        HEADS,
        32,
        128,
    )
    assert (layout.stride_head, layout.stride_token) == (256, HEADS * 256)
    assert layout.blocks_are_dense()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda kv: [], "empty"),
        (lambda kv: [kv[0][0]], "expected vLLM 0.32"),
        (lambda kv: [kv[0], kv[1].float()], "layer 1"),
        (lambda kv: [kv[0], kv[1][:-1]], "layer 1"),
        (lambda kv: [t[..., ::2] for t in kv], "dense"),
    ],
    ids=["empty", "3d", "dtype", "shape", "last-dim-stride"],
)
def test_bad_layers_rejected(make, match):
    kv = _kv(16, 64, "fp16")
    with pytest.raises(ValueError, match=match):
        reference.gather_tokens(make(kv), torch.tensor([0]), _token_buf(kv, 1))


def test_bad_buffers_rejected():
    kv = _kv(16, 64, "fp16")
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="expected"):
        reference.gather_tokens(kv, slots, _token_buf(kv, 3))
    with pytest.raises(ValueError, match="float32"):
        reference.gather_tokens(kv, slots, _token_buf(kv, 2).float())
    with pytest.raises(ValueError, match="contiguous"):
        reference.gather_tokens(kv, slots, _token_buf(kv, 2).transpose(3, 4).contiguous().transpose(3, 4))
    with pytest.raises(ValueError, match="int32/int64"):
        reference.gather_tokens(kv, slots.float(), _token_buf(kv, 2))
    with pytest.raises(ValueError, match="n_blocks"):
        reference.gather_blocks(kv, slots, torch.empty((LAYERS, 3, 10), dtype=torch.float16))


def test_block_copy_refuses_non_dense_blocks():
    base = torch.zeros((4, 2, 16, 2 * 64 + 8), dtype=torch.float16)
    kv = [base[..., : 2 * 64]]  # padded rows: tokens are fine, blocks are not one region
    layout = PagedLayout.from_layers(kv)
    assert not layout.blocks_are_dense()
    out = torch.empty((1, 1, layout.block_numel), dtype=torch.float16)
    with pytest.raises(ValueError, match="dense region"):
        reference.gather_blocks(kv, torch.tensor([0]), out)
    reference.gather_tokens(kv, torch.tensor([3]), torch.empty(layout.token_buffer_shape(1), dtype=torch.float16))


def test_copy_segments_moves_byte_ranges_and_refuses_out_of_range():
    from lmcache_cuda import ops

    src = torch.arange(64, dtype=torch.int16)
    dst = torch.zeros(32, dtype=torch.float32)  # other dtype: byte ranges only
    ops.copy_segments([dst, dst], [0, 100], [src, src], [10, 0], [20, 8])
    db, sb = dst.view(torch.uint8), src.view(torch.uint8)
    assert torch.equal(db[:20], sb[10:30]) and torch.equal(db[100:108], sb[:8])
    assert db[20:100].eq(0).all() and db[108:].eq(0).all()
    with pytest.raises(ValueError, match="outside"):
        ops.copy_segments([dst], [120], [src], [0], [16])
    with pytest.raises(ValueError, match="non-contiguous"):
        ops.copy_segments([dst], [0], [src.view(8, 8).t()], [0], [4])


def test_copy_rows_moves_pitched_rows_and_refuses_bad_ones():
    from lmcache_cuda import ops

    src = torch.arange(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    # 3 rows of 10 bytes, 40 apart in the source and 16 apart in the destination; one plain row
    ops.copy_rows([dst, dst], [0, 200], [16, 0], [src, src], [5, 0], [40, 0], [10, 8], [3, 1])
    for r in range(3):
        assert torch.equal(dst[16 * r : 16 * r + 10], src[5 + 40 * r : 15 + 40 * r])
        assert not dst[16 * r + 10 : 16 * r + 16].any()
    assert torch.equal(dst[200:208], src[:8]) and not dst[48:200].any()
    with pytest.raises(ValueError, match="outside"):  # the last row runs past the end
        ops.copy_rows([dst], [0], [16], [src], [0], [125], [10], [3])
    with pytest.raises(ValueError, match="pitch"):
        ops.copy_rows([dst], [0], [4], [src], [0], [40], [10], [2])
    with pytest.raises(ValueError, match="lengths"):
        ops.copy_rows([dst], [0], [4], [src], [0], [40], [10], [2, 1])


@pytest.mark.parametrize("granularity", ["tokens", "blocks"])
def test_layer_copies_move_one_layer(granularity):
    """reference.LayerCopies (the CPU route of the layer pipeline): a gather equals
    that layer of a full gather; a scatter writes that layer only."""
    kv = _kv(16, 64, "fp16", seed=21)
    layout = PagedLayout.from_layers(kv)
    if granularity == "tokens":
        index = ragged_slots(layout.num_blocks, 16, 40, pad=3, seed=22)
        full = reference.gather_tokens(kv, index, _token_buf(kv, index.numel()))
    else:
        index = torch.tensor([4, 1, 2])
        full = torch.empty((layout.num_layers, 3, layout.block_numel), dtype=layout.dtype)
        reference.gather_blocks(kv, index, full)
    copies = reference.LayerCopies(kv, index, granularity)
    for layer in range(layout.num_layers):
        one = torch.empty((1, *full.shape[1:]), dtype=full.dtype)
        copies.run(layer, one, True)
        assert bits_equal(one[0], full[layer])
        dst = [torch.zeros_like(t) for t in kv]
        reference.LayerCopies(dst, index, granularity).run(layer, one, False)
        for i, t in enumerate(dst):
            assert bool(int_view(t).any()) == (i == layer)
    with pytest.raises(IndexError):
        copies.run(layout.num_layers, one, True)
    with pytest.raises(ValueError, match="granularity"):
        reference.LayerCopies(kv, index, "pages")
