"""fp8 frames coded on the transfer path (lmcache_cuda.fp8): a save gathers and encodes
a chunk, a load decodes a frame straight into the paged KV. Held to lmcache_core's CPU
codec byte for byte: the frame a save writes is the codec's frame of the gathered
chunk, and a load writes exactly the codec's decoded values into the chunk's slots and
nothing else. On CPU tensors this runs the reference path (the codec and the torch
copies); on a GPU (marker ``gpu``) the kernels, with pinned and device frames, several
chunks and several parts per chunk. Bad frames and NaN KV are reported, not stored."""

from __future__ import annotations

import pytest
import torch

from lmcache_core.fp8 import Fp8Codec
from lmcache_cuda import fp8, reference
from lmcache_cuda.paged_layout import PagedLayout
from lmcache_cuda.testing import ragged_slots, vllm_kv_caches

CODEC = Fp8Codec()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu")] + ([pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)] if GPU else [])
# where a frame lives: host memory on CPU; pinned host or device memory on a GPU
PLACES = [pytest.param("cpu", "host", id="cpu")] + (
    [pytest.param("cuda", where, id=f"cuda-{where}", marks=pytest.mark.gpu) for where in ("pinned", "device")] if GPU else []
)
LAYERS, BLOCKS, HEADS, BLOCK = 3, 9, 2, 16


@pytest.fixture(autouse=True)
def _kernels_on_gpu(request):
    if "cuda" in request.node.name:
        from lmcache_cuda.dispatch import load_kernels

        load_kernels()  # a build failure fails the GPU cases with its reason


def finite_kv(layout: str, dtype: torch.dtype, device: str, head: int, seed: int) -> list[torch.Tensor]:
    """vLLM-shaped KV holding finite values of varied magnitude (random bytes would hold NaN)."""
    kv = list(vllm_kv_caches(layout, LAYERS, BLOCKS, HEADS, BLOCK, 2 * head, dtype, device, seed=seed).values())
    g = torch.Generator().manual_seed(seed)
    for t in kv:
        vals = torch.randn(t.shape, generator=g) * torch.logspace(-3, 3, t.shape[-1])
        t.copy_(vals.to(dtype).to(device))
    return kv


def chunk(kv: list[torch.Tensor], index: torch.Tensor, tokens: bool) -> torch.Tensor:
    """The chunk buffer the CPU path would store: gathered on CPU copies."""
    cpu = [t.cpu() for t in kv]
    lay = PagedLayout.from_layers(cpu)
    if tokens:
        return reference.gather_tokens(cpu, index.cpu(), torch.empty(lay.token_buffer_shape(index.numel()), dtype=lay.dtype))
    return reference.gather_blocks(cpu, index.cpu(), torch.empty(lay.num_layers, index.numel(), lay.block_numel, dtype=lay.dtype))


def frame_buffer(nbytes: int, device: str, where: str) -> torch.Tensor:
    if device == "cpu":
        return torch.empty(nbytes, dtype=torch.uint8)
    if where == "pinned":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def index_for(tokens: bool, seed: int) -> torch.Tensor:
    if tokens:
        slots = ragged_slots(BLOCKS, BLOCK, 2 * BLOCK + 7, pad=3, seed=seed)
        slots[5] = BLOCKS * BLOCK  # outside the cache: gathered as zeros, never written
        return slots
    return torch.tensor([4, 1, BLOCKS + 2, 7], dtype=torch.int64)  # one id outside the cache


CASES = [
    pytest.param(layout, gran, dt, head, id=f"{layout}-{gran}-{dt}-D{head}")
    for layout in ("LBNHC", "LBHNC", "LHBNC")
    for gran in ("tokens", "blocks")
    for dt in DTYPES
    for head in (64, 40)  # 40: a short last group
    if not (gran == "blocks" and layout == "LHBNC")  # blocks are not dense there
]


@pytest.mark.parametrize("device,where", PLACES)
@pytest.mark.parametrize("layout,gran,dt,head", CASES)
def test_save_then_load_is_the_cpu_codec_byte_for_byte(device, where, layout, gran, dt, head):
    tokens = gran == "tokens"
    kv = finite_kv(layout, DTYPES[dt], device, head, seed=head)
    index = index_for(tokens, seed=1).to(device)
    want = bytes(CODEC.encode_tensor(chunk(kv, index, tokens)))
    out = frame_buffer(len(want), device, where)
    status = fp8.save(kv, index, out, granularity=gran)
    assert status.value() == 0
    assert bytes(out.cpu().numpy()) == want, "the frame differs from the CPU codec's"
    # load it into other KV: exactly the decoded values at the index, nothing else touched
    dst = finite_kv(layout, DTYPES[dt], device, head, seed=head + 100)
    expect = [t.cpu().clone() for t in dst]
    lay = PagedLayout.from_layers(expect)
    shape = lay.token_buffer_shape(index.numel()) if tokens else (LAYERS, index.numel(), lay.block_numel)
    decoded = CODEC.decode_tensor(memoryview(want), lay.dtype, shape, None)
    (reference.scatter_tokens if tokens else reference.scatter_blocks)(expect, index.cpu(), decoded)
    frame = frame_buffer(len(want), device, where)
    frame.copy_(torch.frombuffer(bytearray(want), dtype=torch.uint8))
    for pieces in (1, 3):
        status = fp8.load(dst, index, frame, granularity=gran, pieces=pieces)
        assert status.value() == 0
        for got, exp in zip(dst, expect):
            assert torch.equal(got.cpu().view(torch.uint8), exp.view(torch.uint8))
    # the negative control: the load did change the destination
    assert not all(
        torch.equal(a.cpu(), b.cpu()) for a, b in zip(dst, finite_kv(layout, DTYPES[dt], device, head, seed=head + 100))
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pieces", [1, 4, 1000])
def test_several_chunks_in_one_call_are_chunk_by_chunk(device, pieces):
    kv = finite_kv("LBNHC", torch.bfloat16, device, 64, seed=3)
    indexes = [ragged_slots(BLOCKS, BLOCK, 20 + 9 * i, seed=10 + i).to(device) for i in range(3)]
    frames = [bytes(CODEC.encode_tensor(chunk(kv, ix, True))) for ix in indexes]
    outs = [frame_buffer(len(f), device, "pinned") for f in frames]
    assert fp8.save_many(kv, list(zip(indexes, outs))).value() == 0
    assert [bytes(o.cpu().numpy()) for o in outs] == frames
    dst_many = finite_kv("LBNHC", torch.bfloat16, device, 64, seed=4)
    dst_one = finite_kv("LBNHC", torch.bfloat16, device, 64, seed=4)
    assert fp8.load_many(dst_many, list(zip(indexes, outs)), pieces=pieces).value() == 0
    for ix, o in zip(indexes, outs):
        assert fp8.load(dst_one, ix, o, pieces=1).value() == 0
    for a, b in zip(dst_many, dst_one):
        assert torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gran", ["tokens", "blocks"])
def test_a_bad_frame_is_reported_and_nan_kv_is_not_stored(device, gran):
    tokens = gran == "tokens"
    kv = finite_kv("LBNHC", torch.float16, device, 64, seed=5)
    index = index_for(tokens, seed=2).to(device)
    good = bytes(CODEC.encode_tensor(chunk(kv, index, tokens)))
    cases = {"fine": (None, 0), "NaN code": (len(good) - 3, fp8.NAN_CODE), "scale": (1, fp8.BAD_SCALE)}
    for what, (at, want) in cases.items():
        bad = bytearray(good)
        if at is not None:
            bad[at] = 0x7F if want == fp8.NAN_CODE else 0xFF  # 0xFFxx: a NaN scale
        frame = frame_buffer(len(bad), device, "pinned")
        frame.copy_(torch.frombuffer(bad, dtype=torch.uint8))
        dst = finite_kv("LBNHC", torch.float16, device, 64, seed=6)
        assert fp8.load(dst, index, frame, granularity=gran).value() == want, what
    kv[1][0, 0, 0, 0] = float("nan")  # block 0, slot 0: inside the saved chunk
    poisoned_index = torch.arange(BLOCK, dtype=torch.int64, device=device) if tokens else torch.tensor([0], device=device)
    n = LAYERS * (2 * BLOCK * HEADS * 64 if tokens else BLOCK * HEADS * 128)
    out = frame_buffer(fp8.payload_len(n), device, "pinned")
    st = fp8.save(kv, poisoned_index, out, granularity=gran)
    assert st.value() == fp8.NOT_FINITE
    with pytest.raises(ValueError, match="NaN or infinite"):
        st.check()


def test_wrong_arguments_are_refused():
    kv = finite_kv("LHBNC", torch.bfloat16, "cpu", 64, seed=7)
    index = torch.tensor([0, 1, 2])
    n = LAYERS * 2 * 3 * HEADS * 64
    with pytest.raises(ValueError, match="bytes"):
        fp8.load(kv, index, torch.zeros(fp8.payload_len(n) - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dense"):
        fp8.load(kv, index, torch.zeros(10, dtype=torch.uint8), granularity="blocks")
    with pytest.raises(ValueError, match="granularity"):
        fp8.save(kv, index, torch.zeros(fp8.payload_len(n), dtype=torch.uint8), granularity="rows")
    ints = [t.view(torch.int16) for t in kv]
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        fp8.save(ints, index, torch.zeros(fp8.payload_len(n), dtype=torch.uint8))
