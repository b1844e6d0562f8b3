"""The opt-in ``fp8`` codec: fidelity and size on K/V-like data, decoding
that refuses crafted payloads (never NaN, infinity or another length), and the rule
that a lossy frame satisfies only a tier configured with that codec.

Crafted payloads are framed with a valid checksum (:func:`_frame_with_payload`), so
the refusal comes from the codec's own checks and not from a checksum mismatch; the
same helper with the untouched payload decodes OK (the positive control). The safety
tests each carry their control: the same reads with the unfiltered codec map, or with
a raw writer, are hits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmcache_core.config import ConfigError, load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.fp8 import GROUP, REL_ERROR_BOUND, Fp8Codec, payload_len, scale_limit
from lmcache_core.keys import ChunkKey, KeyNamespace
from lmcache_core.plugins import PluginManager, get_plugin_manager
from lmcache_core.serde import (
    RAW_FALLBACK,
    FrameSeal,
    RawCodec,
    SealedCodec,
    SealedCodecs,
    Verdict,
    decode,
    encode,
    frame_header,
    frame_meta,
    is_lossy,
    payload_checksum,
    tier_codecs,
    try_decode,
)
from lmcache_core.testing.tokens import retrieve_tokens, store_tokens, token_hashes

KEY = ChunkKey(b"\x02" * 16, b"\x01" * 16)
FP8 = Fp8Codec()
CODECS = get_plugin_manager().codec_map()
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
SECRET = "a frame secret of 32 bytes......"


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _kv(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """K/V-like data, [layers, k/v, tokens, heads, head_size]: normal, heavy-tailed
    (Student t, 3 degrees of freedom), or with per-channel outliers (channels whose
    scale differs by e**1.5 on average, as in real K caches)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, 256, 4, 64)
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0) / 3
        x = x / chi2.sqrt()
    elif kind == "outliers":
        x = x * torch.exp(1.5 * torch.randn(64, generator=g))
    return x.to(dtype)


# -- fidelity and size ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kind", ["normal", "heavy", "outliers"])
def test_round_trip_relative_error_within_bound(kind: str, dtype: torch.dtype) -> None:
    x = _kv(kind, dtype)
    y = decode(encode(KEY, x, FP8), CODECS, expect_key=KEY)
    assert y.dtype == dtype and y.shape == x.shape and bool(torch.isfinite(y).all())
    err = _rel_err(y, x)
    assert 0 < err <= REL_ERROR_BOUND, err  # lossy (not 0), within the documented 3%
    out = torch.empty_like(x)
    assert decode(encode(KEY, x, FP8), CODECS, expect_key=KEY, out=out) is out and torch.equal(out, y)


def test_scale_per_group_beats_one_scale_per_chunk() -> None:
    """The control for the granularity: (token, head) rows whose magnitudes span
    six decades (as between layers) keep their precision with a scale per 64
    values; with one scale for the whole chunk the small rows sink into float8's
    subnormals and the error grows several times."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 256, 4, 64, generator=g) * 10 ** (-6 * torch.rand(2, 2, 256, 4, 1, generator=g))
    flat = x.reshape(-1)
    scale = flat.abs().max() / 448
    whole = ((flat / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)
    per_group = decode(encode(KEY, x, FP8), CODECS)

    def row_err(y: torch.Tensor) -> float:  # the mean over (token, head) rows of their relative error
        return float(((y - x).norm(dim=-1) / x.norm(dim=-1)).mean())

    assert row_err(per_group) <= REL_ERROR_BOUND < 3 * REL_ERROR_BOUND < row_err(whole)


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 0.52), (torch.float32, 0.27), (torch.float16, 0.52)])
def test_bytes_per_value_including_header(dtype: torch.dtype, bound: float) -> None:
    """A realistic chunk (256 tokens x k/v x 8 layers x 8 heads x 64): the whole fp8
    frame, header included, against the chunk's bytes at its dtype; the raw frame is
    the control (over 1.0: the header is counted)."""
    x = torch.randn(8, 2, 256, 8, 64).to(dtype)
    raw_bytes = x.numel() * x.element_size()
    frame = encode(KEY, x, FP8)
    assert len(frame) / raw_bytes <= bound
    assert len(frame) - 1000 < payload_len(x.numel()) == 2 * x.numel() // GROUP + x.numel() < len(frame)
    assert len(encode(KEY, x, RawCodec())) / raw_bytes > 1.0


@pytest.mark.parametrize("dtype", FLOATS)
def test_zero_constant_and_extreme_rows(dtype: torch.dtype) -> None:
    big = float(torch.finfo(dtype).max)
    x = torch.zeros(6, GROUP, dtype=torch.float32)
    x[1] = 3.0  # constant
    x[2] = -1e-3
    x[3, ::2] = big  # the dtype's largest values: clipped to 448 * scale_limit, finite
    x[3, 1::2] = -big
    x[4, 0], x[4, 1] = 1000.0, 1e-6  # a tiny value next to a large one: flushed toward 0, finite
    x[5] = torch.tensor(float(torch.finfo(dtype).tiny))  # the smallest normal: kept as zero or tiny
    x = x.to(dtype)
    y = decode(encode(KEY, x, FP8), CODECS)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y[0], torch.zeros_like(y[0]))
    for row, value in ((1, 3.0), (2, -1e-3)):
        assert torch.allclose(y[row].float(), torch.full((GROUP,), value), rtol=1 / 16, atol=0)
    assert float(y[3].float().abs().min()) >= 0.9 * big and float(y[3].float().abs().max()) <= big
    assert abs(float(y[4, 0]) - 1000.0) <= 1000.0 / 16 and abs(float(y[4, 1])) <= 1e-3
    assert float(y[5].float().abs().max()) <= 2 * float(torch.finfo(dtype).tiny)


def test_odd_sizes_and_empty() -> None:
    """A chunk whose size is not a multiple of the group, and an empty one."""
    x = torch.randn(3, 5, 7).to(torch.bfloat16)
    y = decode(encode(KEY, x, FP8), CODECS)
    assert y.shape == x.shape and _rel_err(y, x) <= REL_ERROR_BOUND
    e = torch.empty(0, 4, dtype=torch.float16)
    assert decode(encode(KEY, e, FP8), CODECS).shape == (0, 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_kv_is_not_stored(bad: float) -> None:
    x = torch.randn(4, GROUP)
    x[2, 3] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        encode(KEY, x, FP8)


def test_chunks_fp8_cannot_take_are_framed_raw_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Byte pages (the grouped layouts of hybrid and sliding-window models store
    ``uint8`` pages) and integers cannot be quantized: an fp8 tier frames them raw,
    so it keeps caching (found on real vLLM: an fp8 tier stored nothing for Gemma 3,
    gpt-oss, Mistral with sliding windows and GraniteMoeHybrid), and the log says so
    once per dtype. The codec itself still refuses them."""
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        FP8.encode_tensor(torch.zeros(4, 64, dtype=torch.int32))
    pages = torch.randint(0, 256, (3, 4096), dtype=torch.uint8)
    RAW_FALLBACK.discard(("fp8", "uint8"))  # said already by an earlier test in this process
    with caplog.at_level("WARNING", logger="lmcache_core.serde"):
        frames = [encode(KEY, pages, FP8), encode(KEY, pages, SealedCodec(FP8, FrameSeal(SECRET)))]
        encode(KEY, pages, FP8)
    assert frame_meta(KEY, pages, "raw", pages.nbytes).items() <= json_meta(frames[0]).items()
    fp8_tier = tier_codecs(CODECS, FP8)
    assert torch.equal(decode(frames[0], fp8_tier), pages) and torch.equal(decode(frames[0], CODECS), pages)
    sealed = SealedCodecs(CODECS, FrameSeal(SECRET))
    assert torch.equal(decode(frames[1], sealed), pages)  # still sealed
    assert try_decode(frames[1], CODECS).verdict is not Verdict.OK
    said = [r for r in caplog.records if "cannot encode uint8" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    ints = torch.arange(256, dtype=torch.int32).reshape(4, 64)
    assert torch.equal(decode(encode(KEY, ints, FP8), fp8_tier), ints)


def json_meta(frame: bytes) -> dict[str, str]:
    from lmcache_core.serde import parse_header

    return parse_header(frame)[1]


def test_byte_codec_contract_unchanged() -> None:
    """A tier that calls ``codec.encode(bytes)`` directly (a byte codec's contract)
    gets a clear error from fp8, never a frame it could not decode."""
    with pytest.raises(TypeError, match="encodes tensors"):
        FP8.encode(memoryview(b"\0" * 128))


# -- crafted payloads: each a miss, never NaN, infinity or another length --------------


def _frame_with_payload(x: torch.Tensor, payload: bytes, *, dtype: str | None = None, shape: str | None = None) -> bytes:
    """An fp8 frame for ``x``'s header with ``payload``, checksummed correctly."""
    meta = frame_meta(KEY, x, "fp8", x.numel() * x.element_size())
    if dtype is not None:
        meta["dtype"] = dtype
    if shape is not None:
        meta["shape"] = shape
    return frame_header(meta, payload_checksum(meta, payload), len(payload)) + payload


def _good() -> tuple[torch.Tensor, bytes]:
    x = torch.randn(4, 2 * GROUP).to(torch.bfloat16)
    return x, bytes(FP8.encode_tensor(x))


def _set_scale(payload: bytes, index: int, value: float) -> bytes:
    bits = np.array([value], dtype=np.float32).view(np.uint32)[0] >> 16  # bfloat16 bits of value (truncated)
    b = bytearray(payload)
    b[2 * index : 2 * index + 2] = int(bits).to_bytes(2, "little")
    return bytes(b)


def test_crafting_helper_reaches_the_codec() -> None:
    """Positive control: the helper's frame with the codec's own payload is a hit."""
    x, payload = _good()
    got = try_decode(_frame_with_payload(x, payload), CODECS, expect_key=KEY, out=torch.empty_like(x))
    assert got.verdict is Verdict.OK and _rel_err(got.tensor, x) <= REL_ERROR_BOUND


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda p: p[:-1], id="truncated"),
        pytest.param(lambda p: p + b"\0", id="one-byte-longer"),
        pytest.param(lambda p: p[: 2 * 8], id="scales-only"),
        pytest.param(lambda p: _set_scale(p, 1, float("nan")), id="scale-nan"),
        pytest.param(lambda p: _set_scale(p, 2, float("inf")), id="scale-inf"),
        pytest.param(lambda p: _set_scale(p, 0, -1.0), id="scale-negative"),
        pytest.param(lambda p: _set_scale(p, 3, 1e38), id="scale-huge"),
        pytest.param(lambda p: p[:20] + b"\x7f" + p[21:], id="nan-code"),
        pytest.param(lambda p: p[:30] + b"\xff" + p[31:], id="negative-nan-code"),
    ],
)
def test_crafted_payload_is_a_corrupt_miss(edit) -> None:  # type: ignore[no-untyped-def]
    x, payload = _good()
    bad = edit(payload)
    assert bad != payload
    for out in (torch.empty_like(x), None):
        got = try_decode(_frame_with_payload(x, bad), CODECS, expect_key=KEY, out=out)
        assert got.verdict is Verdict.CORRUPT and got.tensor is None, got


def test_scale_at_the_limit_decodes_finite() -> None:
    """The largest scale a frame may hold with the largest float8 codes: finite
    values of the dtype (the limit is what keeps them so)."""
    for dtype in FLOATS:
        x = torch.zeros(GROUP, dtype=dtype)
        limit = scale_limit(dtype)
        payload = _set_scale(bytes(2) + bytes([0x7E, 0xFE] * (GROUP // 2)), 0, limit)
        got = try_decode(_frame_with_payload(x, payload), CODECS, out=torch.empty_like(x))
        assert got.verdict is Verdict.OK and bool(torch.isfinite(got.tensor).all())
        assert float(got.tensor.float().abs().max()) == pytest.approx(448 * limit, rel=1e-2)


def test_fp8_frame_of_an_integer_dtype_is_a_miss() -> None:
    x, payload = _good()
    frame = _frame_with_payload(x, payload, dtype="int16")
    assert try_decode(frame, CODECS, expect_key=KEY).verdict is Verdict.CORRUPT


def test_huge_declared_size_is_refused_before_allocating() -> None:
    """A header claiming 256 MiB of float32 from a 1 KiB payload: refused by the
    codec's ``max_ratio`` (4) before any allocation, even with a raised cap."""
    x = torch.zeros(1 << 20, 64)
    payload = b"\0" * 1024
    frame = _frame_with_payload(x, payload)
    got = try_decode(frame, CODECS, max_raw_bytes=1 << 40)
    assert got.verdict is Verdict.CORRUPT and "at most 4x" in (got.reason or "")


# -- a lossy frame satisfies only a tier configured with that codec --------------------


def test_lossless_tier_refuses_fp8_frames_as_foreign() -> None:
    x = _kv("normal", torch.bfloat16)
    frame = encode(KEY, x, FP8)
    raw_reader = tier_codecs(CODECS, CODECS["raw"])
    got = try_decode(frame, raw_reader, expect_key=KEY, out=torch.empty_like(x))
    assert got.verdict is Verdict.FOREIGN and "lossy" in (got.reason or "")
    assert try_decode(frame, tier_codecs(CODECS, CODECS["lz4"]), expect_key=KEY).verdict is Verdict.FOREIGN
    # controls: the tier configured with fp8, and the unfiltered map, decode it
    assert try_decode(frame, tier_codecs(CODECS, FP8), expect_key=KEY).verdict is Verdict.OK
    assert try_decode(frame, CODECS, expect_key=KEY).verdict is Verdict.OK
    # an fp8 tier still reads lossless frames (exact KV is good for everyone)
    raw_frame = encode(KEY, x, RawCodec())
    got = try_decode(raw_frame, tier_codecs(CODECS, FP8), expect_key=KEY)
    assert got.verdict is Verdict.OK and torch.equal(got.tensor, x)


def test_sealed_fp8_frame_also_refused_by_sealed_lossless_tier() -> None:
    seal = FrameSeal(SECRET)
    sealed = SealedCodecs(CODECS, seal)
    x = _kv("heavy", torch.float16)
    frame = encode(KEY, x, SealedCodec(FP8, seal))
    assert is_lossy(sealed["fp8"]) and b'"auth"' in frame[:2048]
    raw_reader = tier_codecs(sealed, sealed["raw"])
    assert isinstance(raw_reader, SealedCodecs)  # still checks the seal
    assert try_decode(frame, raw_reader, expect_key=KEY).verdict is Verdict.FOREIGN
    got = try_decode(frame, tier_codecs(sealed, sealed["fp8"]), expect_key=KEY)
    assert got.verdict is Verdict.OK and _rel_err(got.tensor, x) <= REL_ERROR_BOUND
    # the seal still applies to the fp8 tier: an unsealed fp8 frame is refused there
    assert try_decode(encode(KEY, x, FP8), tier_codecs(sealed, sealed["fp8"]), expect_key=KEY).verdict is Verdict.FOREIGN


CHUNK = 256
SHAPE = (2, 2, CHUNK, 4, 64)


def _disk_engine(disk: Path, serde: str | None, secret: bool) -> CacheEngine:
    tier: dict[str, object] = {"name": "disk", "path": str(disk)}
    if serde is not None:
        tier["serde"] = serde
    overrides: dict[str, object] = {
        "chunk_size": CHUNK,
        "backends": [{"name": "local_cpu", "max_size": "64MiB"}, tier],
    }
    if secret:
        overrides["frame_secret"] = SECRET
    return CacheEngine(load_config(env={}, overrides=overrides), namespace=KeyNamespace(model="fp8-test"))


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "sealed"])
def test_shared_disk_fp8_frames_are_misses_for_a_raw_engine(tmp_path: Path, secret: bool) -> None:
    """Two engines on one disk directory: what the fp8-configured one stores is a
    miss for the raw-configured one and a hit (within the bound) for fp8 readers;
    the control: what a raw writer stores is an exact hit for the raw reader."""
    tokens = list(range(2 * CHUNK))
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(SHAPE, generator=g).to(torch.bfloat16) for _ in range(2)]
    with _disk_engine(tmp_path / "d", "fp8", secret) as writer:
        assert writer.tier_codecs[1].name == "fp8" and writer.tier_codecs[0].name == "raw"
        assert store_tokens(writer, tokens, chunks) == 2 and writer.flush(60)
    with _disk_engine(tmp_path / "d", None, secret) as raw_reader:
        outs = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(2)]
        assert retrieve_tokens(raw_reader, tokens, outs) == 0
        assert all(not bool(o.any()) for o in outs)
    with _disk_engine(tmp_path / "d", "fp8", secret) as fp8_reader:
        outs = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(2)]
        assert retrieve_tokens(fp8_reader, tokens, outs) == 2
        assert all(0 < _rel_err(o, c) <= REL_ERROR_BOUND for o, c in zip(outs, chunks))
    with _disk_engine(tmp_path / "r", None, secret) as raw_writer:
        assert store_tokens(raw_writer, tokens, chunks) == 2 and raw_writer.flush(60)
    with _disk_engine(tmp_path / "r", None, secret) as raw_reader:
        outs = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(2)]
        assert retrieve_tokens(raw_reader, tokens, outs) == 2
        assert all(torch.equal(o, c) for o, c in zip(outs, chunks))


def _dict_engine(slow_serde: str) -> CacheEngine:
    backends = [
        {"name": "local_cpu", "max_size": "64MiB"},
        {"name": "example_dict", "max_entries": 100},
        {"name": "example_dict", "max_entries": 100, "serde": slow_serde},
    ]
    cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": backends})
    return CacheEngine(cfg, namespace=KeyNamespace(model="fp8-promote"), plugins=PluginManager())


@pytest.mark.parametrize("slow_serde", ["fp8", "raw"])
def test_chunk_from_a_lossy_tier_is_not_promoted_into_a_lossless_one(slow_serde: str) -> None:
    """CPU tier, a raw tier, an fp8 tier: a chunk served by the fp8 tier goes into
    this engine's own CPU tier but never into the raw tier (which would hand the
    approximation out as exact KV). Control: served by a raw slowest tier, it is."""
    tokens = list(range(16))
    chunk = torch.randn(2, 16, 64).to(torch.bfloat16)
    with _dict_engine(slow_serde) as eng:
        assert [c.name for c in eng.tier_codecs] == ["raw", "raw", slow_serde]
        assert store_tokens(eng, tokens, [chunk]) == 1 and eng.flush(10)
        (key,) = eng.keys(token_hashes(eng, tokens))
        eng.tiers[0].remove(key)
        eng.tiers[1].remove(key)
        out = torch.zeros_like(chunk)
        assert retrieve_tokens(eng, tokens, [out]) == 1 and eng.flush(10)
        assert eng.tiers[0].contains([key]) == 1
        assert eng.tiers[1].contains([key]) == (0 if slow_serde == "fp8" else 1)
        assert torch.equal(out, chunk) == (slow_serde == "raw")


def test_per_tier_serde_is_checked_and_not_passed_to_the_factory() -> None:
    """``serde`` in a tier's section selects its codec (the strict example factory
    would refuse an unknown option); an unknown one names its key path."""
    backends = [{"name": "local_cpu", "max_size": "1MiB"}, {"name": "example_dict", "serde": "zstd"}]
    with pytest.raises(ConfigError, match=r"backends\[1\]\.serde: unknown codec 'zstd'"):
        CacheEngine(load_config(env={}, overrides={"backends": backends}), namespace=KeyNamespace(model="m"))


def test_results_never_alias_the_codec_scratch_buffers() -> None:
    """The codec keeps per-thread working buffers: a decoded tensor (no ``out``)
    and an encoded payload must survive the next call, in this thread or another."""
    import threading

    a, b = _kv("normal", torch.float32, seed=1), _kv("heavy", torch.float32, seed=2)
    fa, fb = encode(KEY, a, FP8), encode(KEY, b, FP8)
    ya = decode(fa, CODECS)
    ya_copy = ya.clone()
    yb = decode(fb, CODECS)
    assert torch.equal(ya, ya_copy) and not torch.equal(ya, yb)
    assert encode(KEY, a, FP8) == fa  # deterministic, and b's encode did not touch it
    results: dict[int, bool] = {}

    def work(i: int) -> None:
        x = _kv("outliers", torch.bfloat16, seed=10 + i)
        ok = True
        for _ in range(5):
            ok &= _rel_err(decode(encode(KEY, x, FP8), CODECS), x) <= REL_ERROR_BOUND
        results[i] = ok

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: True, 1: True, 2: True}


def test_decodes_into_inference_tensors_from_threads_outside_inference_mode() -> None:
    """vLLM's KV cache and the pool views made under it are inference tensors, and the
    tiers decode on their own threads, outside inference mode, where torch refuses to
    write such a tensor. Found on real vLLM: every fp8 frame read back by the disk
    tier failed that way, and the tier removed it as corrupt."""
    x = _kv("normal", torch.bfloat16)
    frame = encode(KEY, x, FP8)
    with torch.inference_mode():
        out = torch.empty_like(x)
        inside = decode(frame, CODECS)  # the thread's scratch buffers made in inference mode
    assert out.is_inference() and _rel_err(inside, x) <= REL_ERROR_BOUND
    assert decode(frame, CODECS, out=out) is out and _rel_err(out, x) <= REL_ERROR_BOUND
    assert not decode(frame, CODECS).is_inference()  # and usable outside afterwards
    # the raw codec into a non-contiguous inference tensor (a copy, not a byte write)
    with torch.inference_mode():
        strided = torch.empty((2, 2, 256, 4, 64), dtype=torch.bfloat16).transpose(0, 1)
    want = x.transpose(0, 1)
    assert decode(encode(KEY, want.contiguous(), RawCodec()), CODECS, out=strided) is strided
    assert torch.equal(strided, want)


def _exact(stored: torch.Tensor, fresh: torch.Tensor) -> tuple[bool, str]:
    return torch.equal(stored, fresh), "bit-identical" if torch.equal(stored, fresh) else "values differ"


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "sealed"])
def test_canary_accepts_fp8_copies_within_bound_and_catches_a_planted_chunk(secret: bool) -> None:
    """``verify_fraction: 1.0`` on an fp8 tier: the fp8 copy and the CPU tier's copy
    promoted from it differ from the recomputation bit-wise, yet are within the
    codec's bound (0 mismatches); another key's chunk, fp8-framed under this key, is
    still a mismatch charged to the fp8 tier (the control that the check can fail)."""
    backends = [{"name": "local_cpu", "max_size": "64MiB"}, {"name": "example_dict", "max_entries": 100, "serde": "fp8"}]
    overrides: dict[str, object] = {"chunk_size": 16, "verify_fraction": 1.0, "backends": backends}
    if secret:
        overrides["frame_secret"] = SECRET
    cfg = load_config(env={}, overrides=overrides)
    g = torch.Generator().manual_seed(9)
    chunk = torch.randn(2, 16, 64, generator=g)  # float32: the exact comparison's tolerance would be 1e-4
    other = torch.randn(2, 16, 64, generator=g)
    tokens = list(range(16))
    with CacheEngine(cfg, namespace=KeyNamespace(model="fp8-canary"), plugins=PluginManager()) as eng:
        assert store_tokens(eng, tokens, [chunk]) == 1 and eng.flush(10)
        (h,) = token_hashes(eng, tokens)
        (key,) = eng.keys([h])
        eng.tiers[0].remove(key)
        out = torch.zeros_like(chunk)
        assert retrieve_tokens(eng, tokens, [out]) == 1 and not torch.equal(out, chunk)  # promoted approximation
        verdicts = eng.canary.verify(h, chunk, _exact)
        assert [(v.tier, v.blame, v.equal) for v in verdicts] == [
            ("local_cpu", "example_dict", True),
            ("example_dict", "example_dict", True),
        ]
        assert all("within the fp8 codec's bound" in v.detail for v in verdicts)
        eng.tiers[0].remove(key)
        eng.tiers[1].remove(key)
        assert eng.tiers[1].put(key, other)  # planted: another key's data, a valid fp8 frame
        (planted,) = eng.canary.verify(h, chunk, _exact)
        assert not planted.equal and planted.blame == "example_dict" and "above the fp8 codec's bound" in planted.detail


def test_worst_case_round_trip_error_is_under_the_canary_bound() -> None:
    """The canary bound rests on this: every value within float8's normal range of
    its group's scale (above 2**-6 of 448 * scale) comes back within 2**-4 of
    itself, whatever its magnitude; so even data made only of such values stays
    well inside the bound."""
    from lmcache_core.fp8 import CANARY_BOUND

    g = torch.Generator().manual_seed(11)
    mags = torch.exp2(-6 * torch.rand(4096, GROUP, generator=g))  # within 2**-6 of each group's max
    mags[:, 0] = 1.0
    x = mags * torch.where(torch.rand(4096, GROUP, generator=g) < 0.5, -1.0, 1.0)
    y = decode(encode(KEY, x, FP8), CODECS)
    worst = float(((y - x).abs() / x.abs()).max())
    assert 0.04 < worst <= 1 / 16 + 1e-6  # the e4m3 step: 2**-3, half of it at most
    assert _rel_err(y, x) <= 1 / 16 < CANARY_BOUND
