"""TransferStream on CPU tensors: the same API, run synchronously, events complete."""

from __future__ import annotations

import pytest
import torch

from lmcache_cuda import PagedLayout, TransferStream
from lmcache_cuda.testing import bits_equal, expected_gather, ragged_slots, random_paged_kv


def test_save_then_layer_by_layer_load_on_cpu():
    kv = random_paged_kv(4, 6, 2, 16, 64, torch.bfloat16, seed=11)
    layout = PagedLayout.from_layers(kv)
    slots = ragged_slots(6, 16, 40, pad=2, seed=12)
    ts = TransferStream("cpu")
    assert ts.stream is None
    out = torch.empty(layout.token_buffer_shape(slots.numel()), dtype=torch.bfloat16)
    ev = ts.save_async(kv, slots, out)
    assert ev.query() and ev.cuda_event is None
    ev.synchronize()
    assert bits_equal(out, expected_gather(kv, slots))

    dst = [torch.zeros_like(t) for t in kv]
    for layer in range(len(dst)):
        ev = ts.load_layer_async(layer, dst, slots, out)
        ts.wait(ev)
        for later in dst[layer + 1 :]:
            assert torch.count_nonzero(later) == 0  # one layer at a time
    check = torch.empty_like(out)
    ts.load_async(dst, slots, out).synchronize()
    ts.save_async(dst, slots, check).synchronize()
    assert bits_equal(check, out)
    ts.synchronize()


def test_blocks_granularity_on_cpu():
    kv = random_paged_kv(2, 4, 2, 32, 128, torch.float16, seed=13)
    layout = PagedLayout.from_layers(kv)
    ids = torch.tensor([2, 0])
    ts = TransferStream("cpu")
    buf = torch.empty((2, 2, layout.block_numel), dtype=torch.float16)
    ts.save_async(kv, ids, buf, granularity="blocks").synchronize()
    dst = [torch.zeros_like(t) for t in kv]
    ts.load_layer_async(1, dst, ids, buf, granularity="blocks").synchronize()
    assert torch.count_nonzero(dst[0]) == 0
    assert bits_equal(dst[1][[2, 0]], kv[1][[2, 0]])
    with pytest.raises(ValueError, match="granularity"):
        ts.save_async(kv, ids, buf, granularity="pages")  # type: ignore[arg-type]


def test_load_layer_checks_its_arguments():
    kv = random_paged_kv(2, 4, 2, 16, 64, torch.float32)
    ts = TransferStream("cpu")
    src = torch.empty((2, 2, 1, 2, 64))
    with pytest.raises(IndexError):
        ts.load_layer_async(2, kv, torch.tensor([0]), src)
    with pytest.raises(ValueError, match="first dim"):
        ts.load_layer_async(0, kv, torch.tensor([0]), src[:1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the default device without a GPU")
def test_default_device_without_gpu_is_cpu():
    assert TransferStream().device == torch.device("cpu")
