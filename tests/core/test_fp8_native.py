"""The fp8 codec's fused kernel (lmcache_core/csrc/fp8_kernel.c, compiled with the
package as lmcache_core._fp8) against its torch path: every variant this CPU runs
writes the same frame bytes and decodes the same bits for every dtype, every finite
16-bit value, random float32 bit patterns, short last groups and random payloads;
the same refusals of bad input, with ``out`` untouched; the fall-back to the torch
path where the package was installed without the kernel; and nothing compiled or
loaded at run time from a directory another user can touch."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest
import torch

from lmcache_core import fp8_native
from lmcache_core.fp8 import Fp8Codec, scale_limit

T = TypeVar("T")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CODEC = Fp8Codec()

try:
    VARIANTS = {k.variant: k for k in fp8_native.variants()}
except fp8_native.KernelUnavailable:
    VARIANTS = {}
pytestmark = pytest.mark.skipif(not VARIANTS, reason="lmcache-core was installed without its compiled fp8 kernel")
# avx512 and avx2 on x86-64 CPUs that have them, generic everywhere: each is held to
# the torch path.
KERNELS = list(VARIANTS)


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    fp8_native.reset()
    yield
    monkeypatch.delenv(fp8_native.ENV, raising=False)
    fp8_native.reset()


def on(path: str, fn: Callable[[], T], monkeypatch: pytest.MonkeyPatch) -> T:
    monkeypatch.setenv(fp8_native.ENV, "torch" if path == "torch" else "native")
    fp8_native.reset()
    if path != "torch":
        fp8_native._state["kernel"] = VARIANTS[path]
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


def test_the_best_variant_is_chosen_and_the_generic_one_is_always_there() -> None:
    assert KERNELS[-1] == "generic"
    assert (k := fp8_native.kernel()) is not None and k.variant == KERNELS[0]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f " in flags and " avx512bw " in flags and sys.platform == "linux" and os.uname().machine == "x86_64":
        assert KERNELS[0] == "avx512"


def test_without_the_compiled_kernel_the_codec_falls_back_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "lmcache_core._fp8", None)  # as if installed without a compiler
    monkeypatch.setenv(fp8_native.ENV, "auto")
    with caplog.at_level(logging.WARNING, logger="lmcache_core.fp8_native"):
        assert fp8_native.kernel() is None
    assert "torch path" in caplog.text and "installed without its compiled fp8 kernel" in caplog.text
    x = torch.randn(1000).to(torch.float16)
    out = CODEC.decode_tensor(CODEC.encode_tensor(x), torch.float16, (1000,), None)
    assert (out.float() - x.float()).norm() / x.float().norm() < 0.03
    monkeypatch.setenv(fp8_native.ENV, "native")
    fp8_native.reset()
    with pytest.raises(fp8_native.KernelUnavailable, match="native.*installed without"):
        fp8_native.kernel()
    monkeypatch.setenv(fp8_native.ENV, "fast")
    fp8_native.reset()
    with pytest.raises(ValueError, match="LMCACHE_FP8_KERNEL='fast'"):
        fp8_native.kernel()


# An engine with an fp8 tier, started and used in a fresh process: which shared
# objects it mapped, and whether any planted library ran.
_PROBE = textwrap.dedent(
    """
    import json, torch
    from lmcache_core import fp8_native
    from lmcache_core.config import load_config
    from lmcache_core.engine import CacheEngine
    from lmcache_core.fp8 import Fp8Codec
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.plugins import PluginManager

    backends = [{"name": "local_cpu", "max_size": "16MiB"}, {"name": "example_dict", "max_entries": 10, "serde": "fp8"}]
    cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": backends})
    with CacheEngine(cfg, namespace=KeyNamespace(model="fp8-probe"), plugins=PluginManager()):
        k = fp8_native.kernel()
        x = torch.randn(4096).to(torch.bfloat16)
        codec = Fp8Codec()
        y = codec.decode_tensor(codec.encode_tensor(x), torch.bfloat16, (4096,), None)
        err = float((y.float() - x.float()).norm() / x.float().norm())
    maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if line.rstrip().endswith(".so")})
    print(json.dumps({"variant": k and k.variant, "err": err, "maps": maps}))
    """
)


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_nothing_is_compiled_or_loaded_from_a_cache_directory_at_run_time(tmp_path: Path) -> None:
    """The round-3 finding: the kernel was compiled into, and loaded by path from,
    ``$LMCACHE_CACHE_DIR`` (a symlinked one made root compile wherever the link
    pointed; a swapped one made it load another user's library). Now every cache
    variable points through a symlink into a directory holding a planted library
    under the old names, no compiler is on PATH, and an engine with an fp8 tier
    runs the kernel all the same: loaded from the installed package, nothing
    written to that directory, nothing of it mapped, the planted code never run."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    marker = tmp_path / "foreign-code-ran"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:  # a library whose constructor leaves a mark, under the names the old loader used
        src = tmp_path / "evil.c"
        src.write_text(
            "#include <stdio.h>\n__attribute__((constructor)) static void mark(void) "
            f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
            "int lmc_fp8_encode(void) { return 0; }\nint lmc_fp8_decode(void) { return 0; }\n"
        )
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(target / "fp8_kernel-0000000000000000.so"), str(src)], check=True)
        for sub in ("", "lmcache-core"):
            (target / sub).mkdir(exist_ok=True)
            shutil.copy(target / "fp8_kernel-0000000000000000.so", target / sub / "_fp8.so")
    link = tmp_path / "cache-link"
    link.symlink_to(target)
    before = sorted((p.relative_to(target), p.stat().st_mtime_ns) for p in target.rglob("*"))
    bare = tmp_path / "bin"  # PATH with the interpreter only: no cc, gcc or clang
    bare.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", fp8_native.ENV)}
    env.update(PATH=str(bare), LMCACHE_CACHE_DIR=str(link), XDG_CACHE_HOME=str(link), HOME=str(link))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    got = _probe(env)
    assert got["variant"] == KERNELS[0] and got["err"] < 0.03
    package = Path(fp8_native.__file__).resolve().parent
    ours = [m for m in got["maps"] if Path(m).name.startswith("_fp8.")]
    assert len(ours) == 1 and Path(ours[0]).resolve().parent == package, got["maps"]
    assert not [m for m in got["maps"] if str(tmp_path) in m], got["maps"]
    assert sorted((p.relative_to(target), p.stat().st_mtime_ns) for p in target.rglob("*")) == before
    assert not marker.exists()
    if cc:  # control: the planted library does run when something loads it
        subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(target / '_fp8.so')!r})"], check=True)
        assert marker.exists()
