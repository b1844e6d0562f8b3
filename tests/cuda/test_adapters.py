"""The connector's layout adapters on vLLM 0.32's real KV layouts, below vLLM.

Per-layer tensors are built the way vLLM builds them (one allocation of logical shape
[L, B, H, N, C] in the memory order of each KVCacheLayout, each layer a [B, H, N, C]
view); fresh random bytes per check, destinations and chunk buffers poisoned with
other bytes; expectations taken token by token from the source on the host. Every
test runs on CPU (the torch path) and, where a GPU is visible, on CUDA (the kernels
when lmcache_cuda's are built, and the torch path beside them: both must write the
same chunk bytes). No vLLM needed: these run on the GPU machine too.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_connector.layouts.grouped_layout import NULL_BLOCK, GroupedLayout
from lmcache_connector.layouts.groups import FULL, STATE, WINDOW, GroupInfo, GroupPlan
from lmcache_connector.layouts.kv_adapters import BlockLayout, LayoutError, TokenLayout, make_layout
from lmcache_connector.transfers.layerwise import LayerPipeline, LoadItem, SaveItem
import lmcache_cuda.ops
from lmcache_cuda.paged_layout import int_view
from lmcache_cuda.testing import VLLM_LAYOUTS, poison_like, vllm_kv_caches

GPU = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if GPU else [])
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES["fp8"] = torch.float8_e4m3fn
DENSE_BLOCKS = {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}  # each block one dense region
L, NB, H, BS, D = 3, 12, 4, 16, 32


def _layout(kind: str, kv: dict, block_size: int, ops: bool = False):
    """``ops``: route copies through lmcache_cuda.ops even for CPU tensors (its torch
    reference then runs them), so the code paths the kernels take on a GPU (batched
    layers, staging buffers) are exercised on CPU too."""
    lay = TokenLayout(kv, block_size, allow_cpu=True) if kind == "token" else BlockLayout(kv, block_size)
    if ops:
        lay._ops = lmcache_cuda.ops
    return lay


def _buf(shape, dtype, device, seed):
    """A chunk buffer full of random bytes: pinned host memory beside a GPU."""
    g = torch.Generator().manual_seed(seed)
    es = torch.empty((), dtype=dtype).element_size()
    n = torch.Size(shape).numel()
    t = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g).view(dtype).view(shape)
    return t.pin_memory() if device == "cuda" else t


def _host(kv: dict) -> dict:
    """Integer views on the host, logical [B, H, N, C] order."""
    return {n: int_view(t).cpu() for n, t in kv.items()}


def _tokens(table, lo, hi, block_size, kernel_block):
    """(kernel block, offset) of each token position lo..hi under ``table``."""
    out = []
    for p in range(lo, hi):
        slot = table[p // block_size] * block_size + p % block_size
        out.append((slot // kernel_block, slot % kernel_block))
    return out


def _check_round_trip(kind, src, dst, block_size, kernel_block, *, seed, lo=0, hi=None, write_from=BS, ops=False):
    """Save tokens lo..hi of a request with one random block table, load them into
    another; exactly the right tokens (whole blocks, for the block adapter) land."""
    g = torch.Generator().manual_seed(seed)
    nb = next(iter(src.values())).shape[0] * kernel_block // block_size  # vLLM's blocks
    hi = hi if hi is not None else 4 * block_size + 7  # a partial last block
    n_blocks = -(-hi // block_size)
    src_table = torch.randperm(nb, generator=g)[:n_blocks].tolist()
    dst_table = torch.randperm(nb, generator=g)[:n_blocks].tolist()
    a, b = _layout(kind, src, block_size, ops), _layout(kind, dst, block_size, ops)
    device = "cuda" if a.device.type == "cuda" else "cpu"
    buf = _buf(a.chunk_shape(hi - lo), a.dtype, device, seed + 1)
    before = _host(dst)
    a.save_chunk(src_table, lo, hi, buf)
    if a._ops is not None:  # the torch path must write the very same chunk bytes
        a2 = _layout(kind, src, block_size)
        a2._ops = None
        buf2 = _buf(a2.chunk_shape(hi - lo), a.dtype, device, seed + 2)
        a2.save_chunk(src_table, lo, hi, buf2)
        assert torch.equal(int_view(buf), int_view(buf2)), "kernels and torch path wrote different chunk bytes"
    b.load_chunk(buf, dst_table, lo, hi, write_from)
    s_host, d_host = _host(src), _host(dst)
    first = write_from if kind == "token" else (write_from // block_size) * block_size
    last = hi if kind == "token" else n_blocks * block_size
    written = set()
    for (sb, so), (db, do) in zip(
        _tokens(src_table, first, last, block_size, kernel_block), _tokens(dst_table, first, last, block_size, kernel_block)
    ):
        written.add((db, do))
        for name in src:
            assert torch.equal(d_host[name][db, :, do], s_host[name][sb, :, so]), f"{name}: token at block {db} offset {do}"
    for name in src:
        changed = (d_host[name] != before[name]).any(dim=-1).any(dim=1)  # [B, N]
        wrote = set(map(tuple, changed.nonzero().tolist()))
        assert wrote <= written, f"{name}: wrote outside the request's blocks: {sorted(wrote - written)[:5]}"
    return a


# (device, route): CPU through the torch path and through lmcache_cuda.ops' reference;
# CUDA through whatever the machine has (the kernels when built).
ROUTES = [("cpu", False), ("cpu", True)] + ([("cuda", False)] if GPU else [])
ROUTE_IDS = [f"{d}-{'ops' if o else 'default'}" for d, o in ROUTES]


@pytest.mark.parametrize("device,ops", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("vllm_layout", list(VLLM_LAYOUTS))
@pytest.mark.parametrize("kind", ["block", "token"])
def test_adapters_round_trip_on_vllm_layouts(device, ops, dtype_name, vllm_layout, kind):
    seed = (sum(map(ord, dtype_name + vllm_layout + kind)) + 7 * ops) % 10_000
    src = vllm_kv_caches(vllm_layout, L, NB, H, BS, 2 * D, DTYPES[dtype_name], device, seed=seed)
    dst = poison_like(src, seed + 7)
    if kind == "block" and vllm_layout not in DENSE_BLOCKS:
        with pytest.raises(LayoutError, match="layout: token"):
            BlockLayout(src, BS)
        return
    a = _check_round_trip(kind, src, dst, BS, BS, seed=seed, ops=ops)
    if kind == "block":
        fp = a.fingerprint()
        assert ("/mem-" in fp) == (vllm_layout in ("LBNHC", "BLNHC")), fp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp8"] if "fp8" in DTYPES else ["bf16"])
@pytest.mark.parametrize("kind", ["block", "token"])
def test_adapters_round_trip_mla(device, dtype_name, kind):
    """MLA: one latent head, C = kv_lora_rank 512 + rope 64."""
    src = vllm_kv_caches("LBNHC", L, NB, 1, BS, 576, DTYPES[dtype_name], device, seed=11)
    dst = poison_like(src, 12)
    a = _check_round_trip(kind, src, dst, BS, BS, seed=13)
    if kind == "block":
        assert a.fingerprint().endswith("/1x16x576")  # H = 1: no in-block order to tell apart


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["block", "token"])
def test_adapters_map_kernel_blocks_smaller_than_vllm_blocks(device, kind):
    """Hybrid models on GPU: vLLM's block of 32 tokens is two kernel blocks of 16."""
    src = vllm_kv_caches("LBNHC", L, 2 * NB, H, BS, 2 * D, torch.bfloat16, device, seed=21)
    dst = poison_like(src, 22)
    a = _check_round_trip(kind, src, dst, 2 * BS, BS, seed=23, hi=3 * 2 * BS + 5, write_from=2 * BS)
    assert a.ratio == 2
    with pytest.raises(LayoutError, match="does not divide"):
        BlockLayout(src, 24)


def test_block_fingerprint_of_the_cpu_layout_is_unchanged():
    """vLLM-CPU's LBHNC blocks keep the fingerprint (and bytes) they had before the
    memory-order rework: caches written by earlier versions still hit."""
    src = vllm_kv_caches("LBHNC", L, NB, H, BS, 2 * D, torch.bfloat16, "cpu", seed=31)
    a = BlockLayout(src, BS)
    assert a.fingerprint().endswith(f"/L{L}/bs{BS}/{H}x{BS}x{2 * D}")
    buf = torch.empty(a.chunk_shape(2 * BS), dtype=torch.bfloat16)
    a.save_chunk([5, 2], 0, 2 * BS, buf)
    layer = next(iter(src.values()))
    assert torch.equal(int_view(buf[0, 1]), int_view(layer[2])) and torch.equal(int_view(buf[0, 0]), int_view(layer[5]))


def test_make_layout_auto():
    src = vllm_kv_caches("LBHNC", L, NB, H, BS, 2 * D, torch.float16, "cpu")
    assert make_layout("auto", src, BS).kind == "block"
    if GPU:
        gpu = vllm_kv_caches("LBNHC", L, NB, H, BS, 2 * D, torch.float16, "cuda")
        assert make_layout("auto", gpu, BS).kind == "token"


# -- the grouped (hybrid) page adapter ---------------------------------------------------
GH, GD, GNB = 2, 8, 64


def _overlaid(device):
    """A window layer, a full layer and a (conv, ssm) state layer over one storage,
    one page per block, as vLLM's hybrid allocator overlays them."""
    page = GH * BS * 2 * GD * 4
    store = torch.zeros(3 * GNB * page, dtype=torch.uint8, device=device)

    def attn(i):
        return store[i * GNB * page : (i + 1) * GNB * page].view(torch.float32).view(GNB, GH, BS, 2 * GD)

    base = store[2 * GNB * page :]
    conv = torch.as_strided(base.view(torch.bfloat16), (GNB, 3, 8), (page // 2, 8, 1))
    f32 = base.view(torch.float32)
    ssm = torch.as_strided(f32, (GNB, 2, 4), (page // 4, 4, 1), storage_offset=f32.storage_offset() + 12)
    caches = {"win": attn(0), "full": attn(1), "mamba": [conv, ssm]}
    plan = GroupPlan(
        (
            GroupInfo(0, WINDOW, BS, ("win",), window=20),
            GroupInfo(1, FULL, BS, ("full",)),
            GroupInfo(2, STATE, BS, ("mamba",), state_mode="align"),
        )
    )
    return store, caches, plan, {0: page, 1: page, 2: page}, {0: page, 1: page, 2: 48 + 32}


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_adapter_round_trip(device):
    store, caches, plan, pages, real = _overlaid(device)
    g = torch.Generator().manual_seed(41)
    store.copy_(torch.randint(0, 256, store.shape, dtype=torch.uint8, generator=g).to(device))
    lay = GroupedLayout(caches, plan, pages, real)
    a = ([1, 2, 3, 4], [10, 11, 12, 13], [NULL_BLOCK] * 3 + [20])
    chunk = _buf(lay.chunk_shape(64), torch.uint8, device, 42)
    lay.save_chunk(a, 0, 64, chunk)
    bnd = _buf(lay.boundary_shape(64), torch.uint8, device, 43)
    assert lay.save_boundary(a, 64, bnd)
    want_full = caches["full"][[10, 11, 12, 13]].cpu()
    want_win = caches["win"][[3, 4]].cpu()
    want_ssm = caches["mamba"][1][20].cpu()
    b = ([NULL_BLOCK, NULL_BLOCK, 30, 31], [40, 41, 42, 43], [NULL_BLOCK] * 3 + [50])
    before = store.cpu()
    lay.load_chunk(chunk, b, 0, 64, write_from=0)
    lay.load_boundary(bnd, b, 64, write_from=0)
    assert torch.equal(int_view(caches["full"][[40, 41, 42, 43]]).cpu(), int_view(want_full))
    assert torch.equal(int_view(caches["win"][[30, 31]]).cpu(), int_view(want_win))
    assert torch.equal(int_view(caches["mamba"][1][50]).cpu(), int_view(want_ssm))
    changed = (store.cpu() != before).view(-1, pages[0]).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {30, 31, GNB + 40, GNB + 41, GNB + 42, GNB + 43, 2 * GNB + 50}


# -- layer by layer -----------------------------------------------------------------------
class _Buf:
    """A chunk buffer as the pipeline sees a pool buffer."""

    def __init__(self, t):
        self.tensor = t
        self.released = False

    def release(self):
        self.released = True


@pytest.mark.parametrize("device,ops", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("kind", ["block", "token"])
@pytest.mark.parametrize("ahead", [True, False], ids=["after-layer", "wait-only"])
def test_layer_pipeline_loads_and_saves_layer_by_layer(device, ops, kind, ahead):
    """A simulated forward: wait for layer i, read it (the first thing layer i's
    attention does), write it, hand it to save_layer (and, as the connector's
    save_kv_layer does, to after_layer, which enqueues later layers' loads). Each
    layer's reads see the loaded KV; saved chunks equal the KV after the forward;
    buffers come back."""
    src = vllm_kv_caches("LBNHC", 4, NB, H, BS, 2 * D, torch.bfloat16, device, seed=51)
    kv = poison_like(src, 52)
    a, lay = _layout(kind, src, BS), _layout(kind, kv, BS, ops)
    names = list(kv)
    pipe = LayerPipeline(lay, names)
    src_table, dst_table = [3, 7, 1, 9], [2, 5, 11, 4]
    bufs = []
    for c in range(2):
        t = _buf(a.chunk_shape(2 * BS), a.dtype, device, 53 + c)
        a.save_chunk(src_table[2 * c : 2 * c + 2], 0, 2 * BS, t)
        bufs.append(_Buf(t))
    pipe.load([LoadItem(bufs[c], dst_table, c * 2 * BS, (c + 1) * 2 * BS, 0) for c in range(2)])
    want = {n: int_view(src[n]).cpu()[src_table] for n in names}
    save = [
        SaveItem(_Buf(_buf(lay.chunk_shape(2 * BS), lay.dtype, device, 60 + c)), dst_table, c * 2 * BS, (c + 1) * 2 * BS)
        for c in range(2)
    ]
    for i, n in enumerate(names):
        pipe.wait_layer(n)
        seen = int_view(kv[n][dst_table]).clone()  # on the compute stream
        kv[n][dst_table[0], :, 0].add_(1)  # the layer writes its KV...
        pipe.save_layer(n, lambda: save)  # ...then hands it over
        if ahead:
            pipe.after_layer(n)
        assert torch.equal(seen.cpu(), want[n]), f"layer {i} computed on KV that had not landed"
    pipe.end_loads()
    stored = pipe.end_saves()
    assert all(b.released for b in bufs) and stored == save and pipe.active
    for c, s in enumerate(stored):
        ref = _buf(lay.chunk_shape(2 * BS), lay.dtype, device, 70)
        lay.save_chunk(dst_table, c * 2 * BS, (c + 1) * 2 * BS, ref)
        assert torch.equal(int_view(s.buf.tensor), int_view(ref)) and s.layers == set(range(4))


@pytest.mark.parametrize("device", DEVICES)
def test_layer_pipeline_gathers_layers_never_handed_over(device):
    """A layer vLLM never passes to save_kv_layer is gathered at the end: a stored
    chunk always has every layer."""
    kv = vllm_kv_caches("LBHNC", 3, NB, H, BS, 2 * D, torch.float16, device, seed=81)
    lay = BlockLayout(kv, BS)
    names = list(kv)
    pipe = LayerPipeline(lay, names)
    s = SaveItem(_Buf(_buf(lay.chunk_shape(BS), lay.dtype, device, 82)), [6], 0, BS)
    pipe.save_layer(names[0], lambda: [s])
    pipe.save_layer("not.a.layer", lambda: [s])
    (out,) = pipe.end_saves()
    ref = _buf(lay.chunk_shape(BS), lay.dtype, device, 83)
    lay.save_chunk([6], 0, BS, ref)
    assert torch.equal(int_view(out.buf.tensor), int_view(ref)) and pipe.late_save_layers == 2


@pytest.mark.parametrize("device", DEVICES)
def test_layer_pipeline_turns_off_when_layers_are_not_waited_for(device):
    kv = vllm_kv_caches("LBNHC", 3, NB, H, BS, 2 * D, torch.float16, device, seed=91)
    lay = _layout("token", kv, BS)
    names = list(kv)
    pipe = LayerPipeline(lay, names)
    t = _buf(lay.chunk_shape(BS), lay.dtype, device, 92)
    # every layer waited for: stays on (the negative control)
    pipe.load([LoadItem(_Buf(t), [4], 0, BS, 0)])
    for n in names:
        pipe.wait_layer(n)
    pipe.end_loads()
    assert pipe.active
    pipe.load([LoadItem(_Buf(t), [4], 0, BS, 0)])
    pipe.wait_layer(names[0])  # layer 0 only
    pipe.end_loads()
    assert not pipe.active


def test_token_slot_mapping_matches_the_block_table():
    """Slots of token ranges (also several ranges at once, the layer pipeline's plan)
    against slot = block_ids[pos // bs] * bs + pos % bs; too few blocks is an error."""
    kv = vllm_kv_caches("LBNHC", 1, NB, H, BS, 2 * D, torch.float16, "cpu", seed=95)
    lay = TokenLayout(kv, BS, allow_cpu=True)
    table = [7, 2, 9, 4]

    def formula(start, end):
        return [table[p // BS] * BS + p % BS for p in range(start, end)]

    for start, end in ((0, 4 * BS), (5, 2 * BS + 3), (BS, BS + 1), (3 * BS - 1, 4 * BS)):
        assert lay.slot_mapping(table, start, end).tolist() == formula(start, end)
    both = lay._slots_many([(table, 0, BS), (table, 2 * BS + 1, 3 * BS)])
    assert both.tolist() == formula(0, BS) + formula(2 * BS + 1, 3 * BS)
    with pytest.raises(IndexError, match="blocks"):
        lay.slot_mapping(table, 0, 4 * BS + 1)


@pytest.mark.parametrize("device,ops", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("vllm_layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("kind", ["block", "token"])
def test_copy_many_equals_chunk_by_chunk_copies(device, ops, vllm_layout, kind):
    """copy_many (every layer of several chunks: one kernel call and a 2-D DMA per
    chunk with the kernels; the worker's batched path on a GPU) writes the same chunk
    bytes and the same KV as save_chunk / load_chunk one chunk at a time, partial
    chunks and write_from included; other blocks stay untouched."""
    src = vllm_kv_caches(vllm_layout, L, NB, H, BS, 2 * D, torch.bfloat16, device, seed=101)
    a = _layout(kind, src, BS, ops)
    src_table, dst_table = [3, 7, 1, 9, 0], [2, 5, 11, 4, 8]
    spans = [(0, 2 * BS), (2 * BS, 4 * BS), (4 * BS, 4 * BS + 5)]  # the last chunk partial
    many = [
        SaveItem(_Buf(_buf(a.chunk_shape(hi - lo), a.dtype, device, 110 + c)), src_table, lo, hi)
        for c, (lo, hi) in enumerate(spans)
    ]
    a.copy_many(many, False)
    a.finish()
    for s in many:
        ref = _buf(a.chunk_shape(s.hi - s.lo), a.dtype, device, 120)
        a.save_chunk(src_table, s.lo, s.hi, ref)
        assert torch.equal(int_view(s.buf.tensor), int_view(ref)), f"chunk {s.lo}..{s.hi}"
    for write_from in (0, BS + 3):
        dst_many, dst_one = poison_like(src, 130), poison_like(src, 130)
        b_many, b_one = _layout(kind, dst_many, BS, ops), _layout(kind, dst_one, BS, ops)
        b_many.copy_many([LoadItem(s.buf, dst_table, s.lo, s.hi, write_from) for s in many], True)
        b_many.finish()
        for s in many:
            b_one.load_chunk(s.buf.tensor, dst_table, s.lo, s.hi, write_from)
        for n in src:
            assert torch.equal(int_view(dst_many[n]).cpu(), int_view(dst_one[n]).cpu()), f"{n}, write_from {write_from}"
        # the control: the loads wrote something
        assert not torch.equal(int_view(dst_many[next(iter(src))]).cpu(), int_view(poison_like(src, 130)[next(iter(src))]).cpu())


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("max_buffers", [64, 4])
def test_index_uploads_reuse_their_pinned_buffers_only_once_read(monkeypatch, max_buffers):
    """More uploads than pinned buffers while the GPU is busy: each upload must still
    land with its own values (a buffer is rewritten only after its copy has run; with
    4 buffers the fifth upload waits for the first copy)."""
    import numpy as np

    from lmcache_connector.layouts import kv_adapters

    monkeypatch.setattr(kv_adapters._PinnedRing, "MAX", max_buffers)
    kv = vllm_kv_caches("LBNHC", 1, NB, H, BS, 2 * D, torch.float16, "cuda", seed=97)
    lay = TokenLayout(kv, BS)
    torch.cuda._sleep(50_000_000)  # the copies queue behind this
    outs = [lay._to_device(np.full(300 + i, i, dtype=np.int64)) for i in range(20)]
    for i, o in enumerate(outs):
        assert o.numel() == 300 + i and bool(o.eq(i).all()), f"upload {i}"


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_index_uploads_from_two_threads_never_share_a_buffer():
    """A background save thread and the model's thread upload indices at once (GPU
    with async saves): every upload lands with its own values."""
    import threading

    import numpy as np

    kv = vllm_kv_caches("LBNHC", 1, NB, H, BS, 2 * D, torch.float16, "cuda", seed=98)
    lay = TokenLayout(kv, BS)
    results: dict[int, list] = {0: [], 1: []}

    def upload(t: int) -> None:
        for i in range(200):
            v = t * 1000 + i
            results[t].append((v, lay._to_device(np.full(257, v, dtype=np.int64))))

    torch.cuda._sleep(20_000_000)
    threads = [threading.Thread(target=upload, args=(t,)) for t in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    for t in (0, 1):
        for v, out in results[t]:
            assert bool(out.eq(v).all()), f"thread {t} upload {v}"
