"""The GPU fp8 arithmetic (cuda/lmcache_cuda/csrc/fp8_math.cuh), run on the host with
no GPU and no CUDA: cuda/native_tests/fp8_math_check.cpp takes the kernels' steps
group by group, and its frames and values must be byte for byte those of
lmcache_core's CPU codec (its fused kernel and its torch path alike): every finite
16-bit value, random float32 bit patterns, subnormals, values past the dtype's scale
limit, short last groups, random payloads; and the same refusals (NaN or infinite
KV, bad scales, float8 NaN codes). Needs a C++ compiler; skipped without one."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from lmcache_core import fp8_native
from lmcache_core.fp8 import _ROUND_UP, FP8_MAX, MIN_SCALE, Fp8Codec, scale_limit

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
CODEC = Fp8Codec()
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def _f32(x: float) -> str:
    """x rounded to float32, printed so that strtof reads the same float back."""
    return repr(struct.unpack("<f", struct.pack("<f", x))[0])


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "fp8_math_check"
    subprocess.run(
        [
            "c++",
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-ffp-contract=off",
            f"-I{CUDA_DIR / 'lmcache_cuda' / 'csrc'}",
            str(CUDA_DIR / "native_tests" / "fp8_math_check.cpp"),
            "-o",
            str(out),
        ],
        check=True,
    )
    return out


def gpu_encode(exe: Path, t: torch.Tensor, tmp: Path) -> tuple[int, bytes]:
    src, dst = tmp / "in.bin", tmp / "out.bin"
    src.write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
    res = subprocess.run(
        [
            str(exe),
            "encode",
            str(CODES[t.dtype]),
            str(t.numel()),
            str(src),
            str(dst),
            _f32(_ROUND_UP / FP8_MAX),
            _f32(MIN_SCALE),
            _f32(scale_limit(t.dtype)),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return int(res.stdout.split()[-1]), dst.read_bytes()


def gpu_decode(exe: Path, payload: bytes, dtype: torch.dtype, n: int, tmp: Path) -> tuple[int, torch.Tensor]:
    src, dst = tmp / "in.bin", tmp / "out.bin"
    src.write_bytes(payload)
    res = subprocess.run(
        [str(exe), "decode", str(CODES[dtype]), str(n), str(src), str(dst), _f32(scale_limit(dtype))],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    raw = bytearray(dst.read_bytes())
    return int(res.stdout.split()[-1]), torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)


@pytest.fixture(params=["native", "torch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The CPU codec through its fused kernel (where built) and through its torch ops."""
    monkeypatch.setenv(fp8_native.ENV, request.param)
    fp8_native.reset()
    if request.param == "native":
        try:
            fp8_native.kernel()
        except fp8_native.KernelUnavailable:
            pytest.skip("lmcache-core was installed without its compiled fp8 kernel")
    yield request.param
    monkeypatch.delenv(fp8_native.ENV)
    fp8_native.reset()


def all_finite_16bit(dtype: torch.dtype) -> torch.Tensor:
    t = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return t[torch.isfinite(t.float())]


def samples(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = [
        torch.randn(4096 + 37, generator=g).to(dtype),  # a short last group
        # magnitudes from underflow to the dtype's largest (clipped by the scale limit)
        (torch.randn(64 * 40, generator=g) * torch.logspace(-30, 30, 64 * 40))
        .clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
        .to(dtype),
        torch.zeros(130, dtype=dtype),
        torch.tensor([0.0, -0.0, 1e-40, -1e-42], dtype=torch.float32).to(dtype),
    ]
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31 - 1, (64 * 200,), generator=g, dtype=torch.int64).to(torch.int32)
        pattern = bits.view(torch.float32)
        out.append(torch.where(torch.isfinite(pattern), pattern, torch.zeros(())))  # every exponent
        out.append(torch.tensor([3.0e38, -3.3e38, 1.0, 2.0**-140], dtype=torch.float32))  # past the scale limit
    else:
        out.append(all_finite_16bit(dtype))
    return out


@pytest.mark.parametrize("dtype", list(CODES), ids=str)
def test_frames_and_values_are_the_cpu_codecs(exe, tmp_path, cpu_path, dtype):
    for t in samples(dtype):
        status, frame = gpu_encode(exe, t, tmp_path)
        want = bytes(CODEC.encode_tensor(t))
        assert status == 0
        assert len(frame) == len(want)
        diff = np.flatnonzero(np.frombuffer(frame, np.uint8) != np.frombuffer(want, np.uint8))
        assert diff.size == 0, f"{diff.size} of {len(want)} bytes differ, first at {diff[:5]}"
        status, values = gpu_decode(exe, frame, dtype, t.numel(), tmp_path)
        ref = CODEC.decode_tensor(memoryview(want), dtype, (t.numel(),), None)
        assert status == 0
        assert torch.equal(values.view(torch.uint8), ref.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", list(CODES), ids=str)
def test_random_payloads_decode_to_the_cpu_codecs_values(exe, tmp_path, cpu_path, dtype):
    rng = np.random.default_rng(3)
    n = 64 * 300 + 5
    groups = -(-n // 64)
    limit = scale_limit(dtype)
    # random bfloat16 scales, the ones the codec would refuse redrawn as a random fraction of the limit
    scales = torch.from_numpy(rng.integers(0, 2**15, groups, dtype=np.int16)).view(torch.bfloat16).float()
    scales = torch.where(scales <= limit, scales, limit * torch.rand(groups, generator=torch.Generator().manual_seed(1)))
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    payload = scales.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes() + codes.tobytes()
    status, values = gpu_decode(exe, payload, dtype, n, tmp_path)
    ref = CODEC.decode_tensor(memoryview(payload), dtype, (n,), None)
    assert status == 0
    assert torch.equal(values.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(CODES), ids=str)
def test_the_same_refusals(exe, tmp_path, dtype):
    good = torch.randn(200).to(dtype)
    for bad_value in (float("nan"), float("inf")):
        t = good.clone()
        t[77] = bad_value
        with pytest.raises(ValueError):
            CODEC.encode_tensor(t)
        assert gpu_encode(exe, t, tmp_path)[0] == 4
    frame = bytearray(CODEC.encode_tensor(good))
    assert gpu_decode(exe, bytes(frame), dtype, 200, tmp_path)[0] == 0  # the control: the frame is fine
    groups = -(-200 // 64)
    cases = {
        "NaN code": (2 * groups + 100, 0x7F, 2),
        "negative NaN code": (2 * groups + 199, 0xFF, 2),
        "negative scale": (1, 0xBF, 1),  # -1.5 (bfloat16 0xBFC0)
        "NaN scale": (3, 0xFF, 1),
    }
    for what, (at, byte, want) in cases.items():
        bad = bytearray(frame)
        bad[at] = byte
        if what == "negative scale":
            bad[0] = 0xC0
        with pytest.raises(ValueError):
            CODEC.decode_tensor(memoryview(bytes(bad)), dtype, (200,), None)
        assert gpu_decode(exe, bytes(bad), dtype, 200, tmp_path)[0] == want, what
    over = bytearray(frame)
    over[0:2] = torch.tensor([scale_limit(dtype) * 2], dtype=torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    with pytest.raises(ValueError):
        CODEC.decode_tensor(memoryview(bytes(over)), dtype, (200,), None)
    assert gpu_decode(exe, bytes(over), dtype, 200, tmp_path)[0] == 1
