"""fp8 on the GPU: a chunk's fp8 frame (0.516x of bfloat16) copied to the device and
decoded into the paged KV there (lmcache_cuda.fp8), against a raw bfloat16
host-to-device copy of the same KV and against today's bfloat16 load (the token
scatter from pinned memory), side by side; the reverse for saves. Bit-identity with
the CPU codec first: the frame a GPU save writes and the values a GPU load writes,
compared byte for byte with lmcache_core's codec on the same chunk."""

from __future__ import annotations

from typing import Any

import torch
from lmcache_core.fp8 import Fp8Codec
from lmcache_cuda import fp8, kernels, reference
from lmcache_cuda.paged_layout import PagedLayout, PreparedLayers

from .common import RESULTS, TABLE, _llama, _time_cuda, _wall, log, section

GOAL = 1.6  # effective load rate against a raw bfloat16 host-to-device copy


def _finite(kv: dict[str, torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    layers = list(kv.values())
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32).to(t.dtype))
    return layers


def _exact(layers: list[torch.Tensor], slots: torch.Tensor) -> dict[str, Any]:
    """GPU save vs the CPU codec's frame; GPU load vs the codec's decoded values."""
    codec = Fp8Codec()
    cpu = [t.cpu() for t in layers]
    lay = PagedLayout.from_layers(cpu)
    buf = reference.gather_tokens(cpu, slots.cpu(), torch.empty(lay.token_buffer_shape(slots.numel()), dtype=lay.dtype))
    want = bytes(codec.encode_tensor(buf))
    out = torch.empty(len(want), dtype=torch.uint8, pin_memory=True)
    st = fp8.save(layers, slots, out).value()
    wrong_bytes = int((out != torch.frombuffer(bytearray(want), dtype=torch.uint8)).sum())
    decoded = codec.decode_tensor(memoryview(want), lay.dtype, buf.shape, None)
    dst = [torch.zeros_like(t) for t in layers]
    st2 = fp8.load(dst, slots, out, pieces=4).value()
    back = torch.empty_like(buf)
    reference.gather_tokens([t.cpu() for t in dst], slots.cpu(), back)
    wrong_values = int((back.view(torch.int16) != decoded.view(torch.int16)).sum())
    return {"frame_bytes": len(want), "wrong_frame_bytes": wrong_bytes, "wrong_loaded_values": wrong_values, "status": [st, st2]}


@section("fp8 on the GPU", gpu_only="tests/cuda/test_fp8_transfers.py runs the reference path on CPU")
def fp8_gpu(quick: bool) -> None:
    iters = 5 if quick else 15
    res: dict[str, Any] = {"rows": []}
    worst_exact = 0
    for tokens in (16, 64, 256):  # 2, 8, 32 MiB of bfloat16 KV
        kv = _llama(8 * tokens, "cuda", seed=tokens)
        layers = PreparedLayers(_finite(kv, tokens))
        nb = layers[0].shape[0]
        perm = torch.randperm(nb)
        slots = (perm[: -(-tokens // 16)].repeat_interleave(16) * 16 + torch.arange(16).repeat(-(-tokens // 16)))[:tokens]
        slots_dev = slots.cuda()
        lay = layers.layout
        shape = lay.token_buffer_shape(tokens)
        raw_host = torch.empty(shape, dtype=lay.dtype, pin_memory=True)
        raw_dev = torch.empty_like(raw_host, device="cuda")
        nbytes = raw_host.numel() * raw_host.element_size()
        mib = nbytes / 2**20
        exact = _exact(list(layers), slots_dev)
        worst_exact = max(worst_exact, exact["wrong_frame_bytes"] + exact["wrong_loaded_values"] + sum(exact["status"]))
        frame = torch.empty(fp8.payload_len(raw_host.numel()), dtype=torch.uint8, pin_memory=True)
        fp8.save(layers, slots_dev, frame).check()
        row: dict[str, Any] = {"MiB": round(mib, 1), "frame_MiB": round(frame.numel() / 2**20, 2), "exact": exact}
        # GPU time (CUDA events)
        h2d = _time_cuda(lambda: raw_dev.copy_(raw_host, non_blocking=True), iters)
        d2h = _time_cuda(lambda: raw_host.copy_(raw_dev, non_blocking=True), iters)
        row["gpu_s"] = {
            "raw_bf16_h2d": h2d,
            "bf16_load": _time_cuda(lambda: kernels.scatter_tokens(layers, slots_dev, raw_host), iters),
            "fp8_load_1": _time_cuda(lambda: fp8.load(layers, slots_dev, frame, pieces=1), iters),
            "fp8_load_4": _time_cuda(lambda: fp8.load(layers, slots_dev, frame, pieces=4), iters),
            "fp8_load_auto": _time_cuda(lambda: fp8.load(layers, slots_dev, frame), iters),
            "raw_bf16_d2h": d2h,
            "bf16_save": _time_cuda(lambda: kernels.gather_tokens(layers, slots_dev, raw_host), iters),
            "fp8_save": _time_cuda(lambda: fp8.save(layers, slots_dev, frame), iters),
        }
        # wall clock per call, the status read included (as a worker would wait)
        row["wall_s"] = {
            "raw_bf16_h2d": _wall(lambda: raw_dev.copy_(raw_host, non_blocking=True), iters, True),
            "bf16_load": _wall(lambda: kernels.scatter_tokens(layers, slots_dev, raw_host), iters, True),
            "fp8_load": _wall(lambda: fp8.load(layers, slots_dev, frame).value(), iters, False),
            "raw_bf16_d2h": _wall(lambda: raw_host.copy_(raw_dev, non_blocking=True), iters, True),
            "fp8_save": _wall(lambda: fp8.save(layers, slots_dev, frame).value(), iters, False),
        }
        # a step of 8 chunks in one call
        frames8 = [frame.clone().pin_memory() for _ in range(8)]
        raw8 = [raw_host.clone().pin_memory() for _ in range(8)]
        items = [(slots_dev, f) for f in frames8]

        def raw_load8() -> None:
            for h in raw8:
                raw_dev.copy_(h, non_blocking=True)

        row["wall_s"]["raw_bf16_h2d_x8"] = _wall(raw_load8, iters, True)
        row["wall_s"]["fp8_load_x8"] = _wall(lambda: fp8.load_many(layers, items).value(), iters, False)
        g, w = row["gpu_s"], row["wall_s"]
        row["ratios"] = {
            "fp8_load_gpu": round(g["raw_bf16_h2d"] / g["fp8_load_auto"], 3),
            "fp8_load_gpu_pieces1": round(g["raw_bf16_h2d"] / g["fp8_load_1"], 3),
            "fp8_load_gpu_pieces4": round(g["raw_bf16_h2d"] / g["fp8_load_4"], 3),
            "bf16_load_gpu": round(g["raw_bf16_h2d"] / g["bf16_load"], 3),
            "fp8_load_wall": round(w["raw_bf16_h2d"] / w["fp8_load"], 3),
            "fp8_load_wall_x8": round(w["raw_bf16_h2d_x8"] / w["fp8_load_x8"], 3),
            "fp8_save_gpu": round(g["raw_bf16_d2h"] / g["fp8_save"], 3),
            "fp8_save_wall": round(w["raw_bf16_d2h"] / w["fp8_save"], 3),
        }
        res["rows"].append(row)
        log(f"  {mib:5.1f} MiB bf16 chunk ({row['frame_MiB']} MiB fp8): exact {exact}")
        log("    GPU time us: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in g.items()))
        log("    wall us: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in w.items()))
        log(f"    ratios to the raw bf16 copy: {row['ratios']}")
        r = row["ratios"]
        TABLE.append(
            (
                f"fp8 load {mib:g} MiB (bf16 KV), rate vs raw bf16 H2D",
                f"GPU time {r['fp8_load_gpu']:.2f}x ({fp8.auto_pieces(frame.numel(), 1)} parts; 1 part {r['fp8_load_gpu_pieces1']:.2f}, 4 parts {r['fp8_load_gpu_pieces4']:.2f}; "
                f"bf16 load {r['bf16_load_gpu']:.2f}), wall {r['fp8_load_wall']:.2f}x, step of 8 wall {r['fp8_load_wall_x8']:.2f}x",
                "PASS" if r["fp8_load_gpu"] >= GOAL else "MISS",
            )
        )
        TABLE.append(
            (
                f"fp8 save {mib:g} MiB, rate vs raw bf16 D2H",
                f"GPU time {r['fp8_save_gpu']:.2f}x, wall {r['fp8_save_wall']:.2f}x",
                "info",
            )
        )
    RESULTS["fp8"] = res
    TABLE.append(
        (
            "fp8 GPU frames/values vs CPU codec",
            f"{worst_exact} wrong (bytes + values + bad statuses) at 2/8/32 MiB",
            "PASS" if worst_exact == 0 else "FAIL",
        )
    )
