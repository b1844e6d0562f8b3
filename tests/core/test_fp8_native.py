"""The fp8 codec's fused kernel (lmcache_core/fp8_kernel.c) against its torch path:
the same frame bytes and the same decoded bits for every dtype, every finite 16-bit
value, random float32 bit patterns, short last groups and random payloads; the same
refusals of bad input, with ``out`` untouched; and the fall-back to the torch path
where the kernel cannot be built."""

from __future__ import annotations

import ctypes
import os
import logging
import platform
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest
import torch

from lmcache_core import fp8_native
from lmcache_core.fp8 import Fp8Codec, scale_limit

T = TypeVar("T")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CODEC = Fp8Codec()

pytestmark = pytest.mark.skipif(fp8_native.kernel() is None, reason="no C compiler here: the kernel cannot be built")


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    fp8_native.reset()
    yield
    monkeypatch.delenv(fp8_native.ENV, raising=False)
    fp8_native.reset()


# On x86 the kernel has an AVX-512 quantizer and a portable one (what other CPUs
# run): both are held to the torch path, the portable one built with -mno-avx512f.
X86 = platform.machine() in ("x86_64", "AMD64")
KERNELS = ["native", "portable"] if X86 else ["native"]
_portable: dict[str, ctypes.CDLL] = {}


def on(path: str, fn: Callable[[], T], monkeypatch: pytest.MonkeyPatch) -> T:
    monkeypatch.setenv(fp8_native.ENV, "native" if path == "portable" else path)
    fp8_native.reset()
    if path == "portable":
        if "dll" not in _portable:
            _portable["dll"] = fp8_native._load(fp8_native.build(extra=("-mno-avx512f",)))
        fp8_native._state["dll"] = _portable["dll"]
    assert (fp8_native.kernel() is None) == (path == "torch")
    return fn()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def samples(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    fi = torch.finfo(dtype)
    out = [
        (torch.randn(4097 * 3, generator=g) * scale).clamp(-fi.max, fi.max).to(dtype)
        for scale in (1e-30, 1e-6, 1e-3, 1.0, 37.0, 1e4, 1e30)
    ]
    heads = torch.randn(256, 8, 64, generator=g)
    heads[:, 3] *= 300.0  # an outlier head
    heads[:, 5] = 0.0
    out.append(heads.to(dtype))
    if dtype == torch.float32:
        raw = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
        floats = raw.view(torch.float32)
        out.append(floats[torch.isfinite(floats)])
    else:  # every finite value of the dtype, in order and shuffled
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        every = every[torch.isfinite(every.float())]
        out += [every, every[torch.randperm(every.numel(), generator=g)]]
    out.append(torch.tensor([0.0, -0.0, fi.tiny, -fi.tiny, fi.max, -fi.max, 1.0], dtype=dtype))
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_writes_the_torch_paths_frames_and_decodes_them_alike(
    dtype: torch.dtype, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for x in samples(dtype):
        ref = on("torch", lambda: bytes(CODEC.encode_tensor(x)), monkeypatch)
        got = on(kernel, lambda: bytes(CODEC.encode_tensor(x)), monkeypatch)
        assert got == ref, f"{x.numel()} values: {sum(a != b for a, b in zip(got, ref))} bytes differ"
        shape = tuple(x.shape)
        ref_out = on("torch", lambda: CODEC.decode_tensor(memoryview(ref), dtype, shape, None), monkeypatch)
        got_out = on(kernel, lambda: CODEC.decode_tensor(memoryview(ref), dtype, shape, None), monkeypatch)
        assert torch.equal(bits(got_out), bits(ref_out))
        # into a caller's tensor, contiguous and not
        into = torch.empty(shape, dtype=dtype)
        assert on(kernel, lambda: CODEC.decode_tensor(memoryview(ref), dtype, shape, into), monkeypatch) is into
        assert torch.equal(bits(into), bits(ref_out))
    strided = torch.empty(64, 6, dtype=dtype)[:, ::2]
    x = samples(dtype)[3][:192].reshape(64, 3)
    frame = on(kernel, lambda: bytes(CODEC.encode_tensor(x)), monkeypatch)
    on(kernel, lambda: CODEC.decode_tensor(memoryview(frame), dtype, (64, 3), strided), monkeypatch)
    ref_out = on("torch", lambda: CODEC.decode_tensor(memoryview(frame), dtype, (64, 3), None), monkeypatch)
    assert torch.equal(bits(strided), bits(ref_out))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1023, 1024, 1025, 10_000])
def test_random_payloads_decode_to_the_same_bits(
    dtype: torch.dtype, n: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(n)
    groups = -(-n // 64)
    magnitudes = torch.tensor([0.0, 1e-38, 1e-6, 1.0, scale_limit(dtype)])
    scales = (torch.rand(groups, generator=g) * magnitudes[torch.randint(0, 5, (groups,), generator=g)]).to(torch.bfloat16)
    codes = torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x12  # not the NaN codes
    payload = bytes(scales.view(torch.uint8).numpy()) + bytes(codes.numpy())
    ref = on("torch", lambda: CODEC.decode_tensor(memoryview(payload), dtype, (n,), None), monkeypatch)
    got = on(kernel, lambda: CODEC.decode_tensor(memoryview(payload), dtype, (n,), None), monkeypatch)
    assert torch.equal(bits(got), bits(ref))


@pytest.mark.parametrize("path", [*KERNELS, "torch"])
def test_bad_input_is_refused_alike_and_out_is_left_alone(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(300).to(torch.bfloat16)
    good = bytes(on(path, lambda: CODEC.encode_tensor(x), monkeypatch))
    groups = 5
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = x.clone()
        bad[299] = value
        with pytest.raises(ValueError, match="NaN or infinite"):
            CODEC.encode_tensor(bad)
    limit = scale_limit(torch.bfloat16)
    for scale, why in ((-1.0, "scale"), (float("nan"), "scale"), (float("inf"), "scale"), (limit * 2, "scale")):
        bad = bytearray(good)
        bad[2:4] = bytes(torch.tensor([scale], dtype=torch.bfloat16).view(torch.uint8).numpy())
        out = torch.full((300,), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=why):
            CODEC.decode_tensor(memoryview(bytes(bad)), torch.bfloat16, (300,), out)
        assert bool((out == 7.0).all())
    for code in (0x7F, 0xFF):
        bad = bytearray(good)
        bad[2 * groups + 299] = code  # the very last value
        out = torch.full((300,), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="NaN code"):
            CODEC.decode_tensor(memoryview(bytes(bad)), torch.bfloat16, (300,), out)
        assert bool((out == 7.0).all())
    # control: the untouched frame decodes
    out = torch.empty(300, dtype=torch.bfloat16)
    CODEC.decode_tensor(memoryview(good), torch.bfloat16, (300,), out)
    assert (out.float() - x.float()).norm() / x.float().norm() < 0.03


def test_without_a_compiler_the_codec_falls_back_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("LMCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(fp8_native.ENV, "auto")
    with caplog.at_level(logging.WARNING, logger="lmcache_core.fp8_native"):
        assert fp8_native.kernel() is None
    assert "torch path" in caplog.text and "no C compiler" in caplog.text
    x = torch.randn(1000).to(torch.float16)
    out = CODEC.decode_tensor(CODEC.encode_tensor(x), torch.float16, (1000,), None)
    assert (out.float() - x.float()).norm() / x.float().norm() < 0.03
    monkeypatch.setenv(fp8_native.ENV, "native")
    fp8_native.reset()
    with pytest.raises(fp8_native.KernelUnavailable, match="native.*no C compiler"):
        fp8_native.kernel()
    monkeypatch.setenv(fp8_native.ENV, "fast")
    fp8_native.reset()
    with pytest.raises(ValueError, match="LMCACHE_FP8_KERNEL='fast'"):
        fp8_native.kernel()


def test_the_library_is_built_once_per_machine_and_source(tmp_path: Path) -> None:
    first = fp8_native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert fp8_native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left


def test_an_engine_with_an_fp8_tier_builds_the_kernel_at_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The kernel is ready before the first request, built where the engine starts;
    control: an engine without an fp8 tier builds nothing."""
    from lmcache_core.config import load_config
    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.plugins import PluginManager

    def engine(serde: str) -> CacheEngine:
        backends = [{"name": "local_cpu", "max_size": "16MiB"}, {"name": "example_dict", "max_entries": 10, "serde": serde}]
        cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": backends})
        return CacheEngine(cfg, namespace=KeyNamespace(model="fp8-prepare"), plugins=PluginManager())

    for serde, built in (("raw", False), ("fp8", True)):
        cache = tmp_path / serde
        monkeypatch.setenv("LMCACHE_CACHE_DIR", str(cache))
        fp8_native.reset()
        with engine(serde):
            assert ("dll" in fp8_native._state) is built
            assert (cache.is_dir() and any(cache.glob("fp8_kernel-*.so"))) is built


def test_a_cache_directory_others_can_write_is_not_trusted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A library is code the process runs: one in a directory other users can write,
    or owned by another user, is not loaded (the torch path runs, saying why)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(fp8_native.KernelUnavailable, match="writable by other users"):
        fp8_native.build(shared)
    assert list(shared.iterdir()) == []  # nothing built there either
    private = tmp_path / "private"
    lib = fp8_native.build(private)  # control: a private directory is used
    assert private.stat().st_mode & 0o777 == 0o700 and lib.stat().st_mode & 0o022 == 0
    lib.chmod(0o666)
    with pytest.raises(fp8_native.KernelUnavailable, match="writable by other users"):
        fp8_native.build(private)
    lib.chmod(0o755)
    assert fp8_native.build(private) == lib
    if os.getuid() == 0:  # only root can give a file away
        os.chown(lib, 1, 1)
        with pytest.raises(fp8_native.KernelUnavailable, match="belongs to uid 1"):
            fp8_native.build(private)
