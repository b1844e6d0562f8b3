"""CUDA kernels against the pure-torch reference, and the side-stream API on a GPU.

Skipped without a GPU. With one, the kernels must build: a build failure fails these
tests (with the compiler's reason) rather than skipping them.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_cuda import PagedLayout, TransferStream, kernels, ops, reference
from lmcache_cuda.dispatch import load_kernels
from lmcache_cuda.testing import DTYPES, bits_equal, expected_gather, ragged_slots, random_paged_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS, HEADS, BLOCKS = 3, 4, 7
MATRIX = [pytest.param(b, d, name, id=f"B{b}-D{d}-{name}") for b in (16, 32, 128) for d in (64, 128) for name in DTYPES]
DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    return load_kernels()  # raises with the build's reason if the kernels are unavailable


def _kv(b, d, name, *, permuted=False, seed=0):
    return random_paged_kv(LAYERS, BLOCKS, HEADS, b, d, DTYPES[name], DEV, permuted=permuted, seed=seed)


def _buf(kv, n, where):
    layout = PagedLayout.from_layers(kv)
    shape = layout.token_buffer_shape(n)
    if where == "pinned":
        return torch.empty(shape, dtype=layout.dtype, pin_memory=True)
    return torch.empty(shape, dtype=layout.dtype, device=DEV)


def test_dispatch_uses_kernels():
    assert ops.implementation(_kv(16, 64, "fp16")) is kernels


@pytest.mark.parametrize("block_size,head_size,dtype_name", MATRIX)
@pytest.mark.parametrize("permuted", [False, True], ids=["contig", "permuted"])
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_token_gather_scatter_match_reference(block_size, head_size, dtype_name, permuted, where):
    kv = _kv(block_size, head_size, dtype_name, permuted=permuted)
    slots = ragged_slots(BLOCKS, block_size, 3 * block_size + 5, pad=4, seed=1)
    slots[7] = BLOCKS * block_size  # out of range: skipped like padding
    slots_dev = slots.to(DEV)
    got = kernels.gather_tokens(kv, slots_dev, _buf(kv, slots.numel(), where))
    want = reference.gather_tokens(kv, slots_dev, _buf(kv, slots.numel(), "device"))
    torch.cuda.synchronize()
    assert bits_equal(got, want)
    assert bits_equal(got, expected_gather(kv, slots))

    dst_k = [torch.zeros_like(t) for t in kv]
    dst_r = [torch.zeros_like(t) for t in kv]
    kernels.scatter_tokens(dst_k, slots_dev, got)
    reference.scatter_tokens(dst_r, slots_dev, want)
    torch.cuda.synchronize()
    for a, b in zip(dst_k, dst_r):
        assert bits_equal(a, b)


@pytest.mark.parametrize("block_size,head_size,dtype_name", MATRIX)
@pytest.mark.parametrize("permuted", [False, True], ids=["contig", "permuted"])
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_block_copy_matches_reference(block_size, head_size, dtype_name, permuted, where):
    kv = _kv(block_size, head_size, dtype_name, permuted=permuted, seed=2)
    layout = PagedLayout.from_layers(kv)
    ids = torch.tensor([5, 0, -1, 6, 2, BLOCKS], device=DEV)
    shape = (LAYERS, ids.numel(), layout.block_numel)
    got = (
        torch.empty(shape, dtype=layout.dtype, pin_memory=True)
        if where == "pinned"
        else torch.empty(shape, dtype=layout.dtype, device=DEV)
    )
    kernels.gather_blocks(kv, ids, got)
    want = reference.gather_blocks(kv, ids, torch.empty(shape, dtype=layout.dtype, device=DEV))
    torch.cuda.synchronize()
    assert bits_equal(got, want)
    dst_k = [torch.zeros_like(t) for t in kv]
    dst_r = [torch.zeros_like(t) for t in kv]
    kernels.scatter_blocks(dst_k, ids, got)
    reference.scatter_blocks(dst_r, ids, want)
    torch.cuda.synchronize()
    for a, b in zip(dst_k, dst_r):
        assert bits_equal(a, b)


@pytest.mark.parametrize("offset_bytes", [2, 4, 8])
def test_misaligned_buffers_fall_back_to_narrower_vectors(offset_bytes):
    kv = _kv(16, 64, "fp16")
    slots = ragged_slots(BLOCKS, 16, 29, seed=3).to(DEV)
    layout = PagedLayout.from_layers(kv)
    n = layout.num_layers * 2 * 29 * HEADS * 64
    raw = torch.empty(n * 2 + 16, dtype=torch.uint8, device=DEV)
    out = raw[offset_bytes : offset_bytes + 2 * n].view(torch.float16).view(layout.token_buffer_shape(29))
    kernels.gather_tokens(kv, slots, out)
    want = reference.gather_tokens(kv, slots, torch.empty_like(out))
    torch.cuda.synchronize()
    assert bits_equal(out, want)
    # Misaligned layer bases too: views starting 2 bytes into a bigger allocation.
    big = [torch.zeros(t.numel() + 8, dtype=torch.float16, device=DEV) for t in kv]
    shifted = [b[1 : 1 + t.numel()].view(t.shape) for b, t in zip(big, kv)]
    kernels.scatter_tokens(shifted, slots, out)
    back = reference.gather_tokens(shifted, slots, torch.empty_like(out))
    torch.cuda.synchronize()
    assert bits_equal(back, want)


def test_empty_and_int32_slot_mappings():
    kv = _kv(32, 128, "bf16")
    empty = torch.empty(0, dtype=torch.int64, device=DEV)
    kernels.gather_tokens(kv, empty, _buf(kv, 0, "device"))
    kernels.scatter_tokens(kv, empty, _buf(kv, 0, "device"))
    slots = torch.tensor([3, 70, 100], dtype=torch.int32, device=DEV)
    got = kernels.gather_tokens(kv, slots, _buf(kv, 3, "pinned"))
    torch.cuda.synchronize()
    assert bits_equal(got, expected_gather(kv, slots.cpu().long()))


def test_many_layers_one_launch():
    kv = random_paged_kv(80, 4, 8, 16, 128, torch.float16, DEV, seed=4)
    slots = ragged_slots(4, 16, 50, seed=5).to(DEV)
    got = kernels.gather_tokens(kv, slots, _buf(kv, 50, "device"))
    want = reference.gather_tokens(kv, slots, _buf(kv, 50, "device"))
    torch.cuda.synchronize()
    assert bits_equal(got, want)


def test_side_stream_save_overlaps_and_orders_after_compute():
    kv = _kv(16, 128, "fp16", seed=6)
    layout = PagedLayout.from_layers(kv)
    slots = ragged_slots(BLOCKS, 16, 60, seed=7).to(DEV)
    ts = TransferStream(DEV)
    # Compute stream writes the KV (slowly), then the save must see the written values.
    a = torch.randn(2048, 2048, device=DEV)
    for _ in range(20):
        a = a @ a / 2048
    for t in kv:
        t.fill_(1.5)
    out = torch.empty(layout.token_buffer_shape(60), dtype=torch.float16, pin_memory=True)
    ev = ts.save_async(kv, slots, out)
    ev.synchronize()
    assert ev.query()
    assert torch.all(out == 1.5)


def test_side_stream_layer_by_layer_load():
    kv = _kv(32, 64, "bf16", seed=8)
    layout = PagedLayout.from_layers(kv)
    slots = ragged_slots(BLOCKS, 32, 90, pad=2, seed=9).to(DEV)
    host = torch.empty(layout.token_buffer_shape(slots.numel()), dtype=torch.bfloat16, pin_memory=True)
    ts = TransferStream(DEV)
    ts.save_async(kv, slots, host).synchronize()
    dst = [torch.zeros_like(t) for t in kv]
    events = [ts.load_layer_async(i, dst, slots, host) for i in range(LAYERS)]
    check = torch.empty(layout.token_buffer_shape(slots.numel()), dtype=torch.bfloat16, device=DEV)
    for i, ev in enumerate(events):
        ts.wait(ev)  # wait_for_layer_load: the compute stream waits on the GPU
        reference.gather_tokens([dst[i]], slots, check[i : i + 1])
    torch.cuda.current_stream().synchronize()
    assert bits_equal(check.cpu(), host)
    ts.synchronize()


def test_side_stream_blocks_and_all_layer_load():
    kv = _kv(16, 64, "fp32", seed=10)
    layout = PagedLayout.from_layers(kv)
    ids = torch.tensor([1, 4, 6], device=DEV)
    host = torch.empty((LAYERS, 3, layout.block_numel), dtype=torch.float32, pin_memory=True)
    ts = TransferStream(DEV, priority=-1)
    ts.save_async(kv, ids, host, granularity="blocks").synchronize()
    dst = [torch.zeros_like(t) for t in kv]
    ev = ts.load_async(dst, ids, host, granularity="blocks")
    ts.wait(ev)
    torch.cuda.current_stream().synchronize()
    for a, b in zip(dst, kv):
        assert bits_equal(a[[1, 4, 6]], b[[1, 4, 6]])


@pytest.mark.parametrize("where", ["device", "pinned"])
def test_copy_segments_native_matches_reference(where):
    g = torch.Generator().manual_seed(12)
    src_host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    src = src_host.pin_memory() if where == "pinned" else src_host.to(DEV)
    dst_k = torch.zeros(1 << 20, dtype=torch.uint8, device=DEV)
    dst_r = torch.zeros_like(dst_k)
    offs, sizes = [0, 4096, 99_999, 500_000], [4096, 1, 65_536, 0]
    src_offs = [1000, 0, 300_000, 5]
    kernels.copy_segments([dst_k] * 4, offs, [src] * 4, src_offs, sizes)
    reference.copy_segments([dst_r] * 4, offs, [src] * 4, src_offs, sizes)
    torch.cuda.synchronize()
    assert torch.equal(dst_k.cpu(), dst_r.cpu()) and dst_k.count_nonzero() > 0
    with pytest.raises(ValueError, match="outside"):
        kernels.copy_segments([dst_k], [(1 << 20) - 4], [src], [0], [8])


@pytest.mark.parametrize("where", ["device", "pinned"])
@pytest.mark.parametrize("to_host", [False, True], ids=["to-device", "to-host"])
def test_copy_rows_native_matches_reference(where, to_host):
    """2-D DMAs (the K and V rows of a chunk's layer) against the reference loop."""
    g = torch.Generator().manual_seed(13)
    src_host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    src = src_host.pin_memory() if where == "pinned" else src_host.to(DEV)
    if to_host:  # device -> pinned host, the saves' direction
        src = src_host.to(DEV)
        dst_k = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    else:
        dst_k = torch.zeros(1 << 20, dtype=torch.uint8, device=DEV)
    dst_r = torch.zeros(1 << 20, dtype=torch.uint8, device=DEV)
    args = ([0, 300_000, 700_000], [200_000, 0, 1], [5, 123_456, 9], [150_000, 0, 3], [70_000, 4096, 0], [2, 1, 4])
    dst_off, dst_pitch, src_off, src_pitch, width, rows = args
    kernels.copy_rows([dst_k] * 3, dst_off, dst_pitch, [src] * 3, src_off, src_pitch, width, rows)
    reference.copy_rows([dst_r] * 3, dst_off, dst_pitch, [src] * 3, src_off, src_pitch, width, rows)
    torch.cuda.synchronize()
    assert torch.equal(dst_k.cpu(), dst_r.cpu()) and dst_k.count_nonzero() > 0
    with pytest.raises(ValueError, match="outside"):
        kernels.copy_rows([dst_k], [(1 << 20) - 100], [60], [src], [0], [60], [50], [2])
    with pytest.raises(ValueError, match="pitch"):
        kernels.copy_rows([dst_k], [0], [10], [src], [0], [60], [50], [2])


@pytest.mark.parametrize("granularity", ["tokens", "blocks"])
@pytest.mark.parametrize("permuted", [False, True], ids=["contig", "permuted"])
def test_layer_copies_match_reference_layer_by_layer(granularity, permuted):
    """kernels.LayerCopies (one launch per layer, checked once) against the reference
    on each layer, both directions; a scatter writes its layer only."""
    kv = _kv(16, 128, "bf16", permuted=permuted, seed=11)
    layout = PagedLayout.from_layers(kv)
    if granularity == "tokens":
        index = ragged_slots(BLOCKS, 16, 2 * 16 + 3, pad=2, seed=12).to(DEV)
        shape = (1, 2, index.numel(), HEADS, 128)
    else:
        if not layout.blocks_are_dense():
            with pytest.raises(ValueError, match="dense"):
                kernels.LayerCopies(kv, torch.tensor([1, 2], device=DEV), granularity)
            return
        index = torch.tensor([5, 0, 3], device=DEV)
        shape = (1, index.numel(), layout.block_numel)
    fast = kernels.LayerCopies(kv, index, granularity)
    ref = reference.LayerCopies(kv, index, granularity)
    for layer in range(LAYERS):
        got = torch.full(shape, 7, dtype=torch.bfloat16, device=DEV)
        want = torch.full(shape, 3, dtype=torch.bfloat16, device=DEV)
        fast.run(layer, got, True)
        ref.run(layer, want, True)
        torch.cuda.synchronize()
        assert bits_equal(got, want)
        dst_k = [torch.zeros_like(t) for t in kv]
        dst_r = [torch.zeros_like(t) for t in kv]
        kernels.LayerCopies(dst_k, index, granularity).run(layer, got, False)
        reference.LayerCopies(dst_r, index, granularity).run(layer, want, False)
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(dst_k, dst_r)):
            assert bits_equal(a, b)
            if i != layer:  # other layers untouched
                assert not a.view(torch.int16).any()


def test_layer_copies_refuse_wrong_buffers_and_layers():
    """Checked in Python before the native call (a native check would throw)."""
    kv = _kv(16, 64, "fp16")
    slots = torch.arange(10, device=DEV)
    fast = kernels.LayerCopies(kv, slots, "tokens")
    good = torch.empty((1, 2, 10, HEADS, 64), dtype=torch.float16, device=DEV)
    fast.run(0, good, True)  # the control
    for bad in (
        torch.empty((1, 2, 9, HEADS, 64), dtype=torch.float16, device=DEV),
        torch.empty((1, 2, 10, HEADS, 64), dtype=torch.float32, device=DEV),
        torch.empty((1, 2, 10, HEADS, 64), dtype=torch.float16),
        torch.empty((1, 2, 10, HEADS, 128), dtype=torch.float16, device=DEV)[..., :64],
    ):
        with pytest.raises(ValueError, match="expected"):
            fast.run(0, bad, True)
    with pytest.raises(IndexError):
        fast.run(LAYERS, good, True)
    with pytest.raises(ValueError, match="granularity"):
        kernels.LayerCopies(kv, slots, "pages")
