"""The frame format: a changed frame never decodes to different data (flipped bytes,
truncation, appended bytes, another frame's header, a wrong expected key, edited
headers and garbage are misses); round trips across dtypes, shapes and codecs; no
pickle; safetensors can read a frame; the pieces for tiers that move header and
payload separately rebuild the same frame."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_core import serde
from lmcache_core.keys import KeyNamespace
from lmcache_core.serde import DTYPES, FrameError, Lz4Codec, RawCodec, decode, encode, parse_header, try_decode

CODECS = {"raw": RawCodec(), "lz4": Lz4Codec()}
NS = KeyNamespace(model="serde-test")
KEY = NS.key(b"\x01" * 16)
OTHER_KEY = NS.key(b"\x02" * 16)
JSON_WS = b" \t\n\r"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_tensor(seed: int, shape: tuple[int, ...] = (2, 3, 8), dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def header_span(frame: bytes) -> tuple[int, int]:
    """(start, end) of the JSON header inside the frame."""
    (hlen,) = struct.unpack_from("<Q", frame)
    return 8, 8 + hlen


def padding_span(frame: bytes) -> tuple[int, int]:
    """The trailing spaces that pad the header to a multiple of 8."""
    start, end = header_span(frame)
    body = frame[start:end]
    return start + len(body.rstrip(b" ")), end


frames = st.builds(
    lambda seed, codec, zeros: (
        t := (torch.zeros(4, 16, dtype=torch.float16) if zeros else make_tensor(seed)),
        codec,
        encode(KEY, t, CODECS[codec]),
    ),
    st.integers(0, 2**16),
    st.sampled_from(["raw", "lz4"]),
    st.booleans(),
)


def assert_miss_or_same(frame: bytes, original: torch.Tensor) -> None:
    """The property every corruption test checks: a miss with a reason, or (only if
    the change was immaterial) exactly the original bytes."""
    got, reason = try_decode(frame, CODECS, expect_key=KEY)
    if got is not None:
        assert raw_bytes(got) == raw_bytes(original) and got.shape == original.shape and got.dtype == original.dtype
    else:
        assert reason
    with pytest.raises(FrameError) if got is None else _nothing():
        decode(frame, CODECS, expect_key=KEY)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


@FUZZ
@given(frames, st.data())
def test_flipped_bytes_never_decode_to_other_data(item: tuple[torch.Tensor, str, bytes], data: st.DataObject) -> None:
    t, _, frame = item
    n = data.draw(st.integers(1, 4), label="flips")
    bad = bytearray(frame)
    positions = data.draw(st.lists(st.integers(0, len(frame) - 1), min_size=n, max_size=n, unique=True), label="pos")
    for pos in positions:
        bad[pos] ^= data.draw(st.integers(1, 255), label="xor")
    got, _ = try_decode(bytes(bad), CODECS, expect_key=KEY)
    if got is not None:
        # Only whitespace in the header padding may change without effect.
        lo, hi = padding_span(frame)
        assert all(lo <= p < hi and bad[p] in JSON_WS for p in positions), positions
    assert_miss_or_same(bytes(bad), t)


@FUZZ
@given(frames, st.data())
def test_any_single_flip_outside_padding_is_a_miss(item: tuple[torch.Tensor, str, bytes], data: st.DataObject) -> None:
    _, _, frame = item
    lo, hi = padding_span(frame)
    pos = data.draw(st.integers(0, len(frame) - 1).filter(lambda p: not lo <= p < hi), label="pos")
    bad = bytearray(frame)
    bad[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(FrameError):
        decode(bytes(bad), CODECS, expect_key=KEY)


@FUZZ
@given(frames, st.data())
def test_truncation_anywhere_is_a_miss(item: tuple[torch.Tensor, str, bytes], data: st.DataObject) -> None:
    _, _, frame = item
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    got, reason = try_decode(frame[:cut], CODECS, expect_key=KEY)
    assert got is None and reason


@FUZZ
@given(frames, st.binary(min_size=1, max_size=64))
def test_appended_bytes_are_a_miss(item: tuple[torch.Tensor, str, bytes], extra: bytes) -> None:
    _, _, frame = item
    with pytest.raises(FrameError, match="length mismatch"):
        decode(frame + extra, CODECS, expect_key=KEY)


@FUZZ
@given(st.integers(0, 2**16), st.integers(0, 2**16), st.sampled_from(["raw", "lz4"]))
def test_header_from_another_frame_is_a_miss(seed_a: int, seed_b: int, codec: str) -> None:
    a, b = make_tensor(seed_a), make_tensor(seed_b)
    fa, fb = encode(KEY, a, CODECS[codec]), encode(KEY, b, CODECS[codec])
    _, end_a = header_span(fa)
    _, end_b = header_span(fb)
    spliced = fa[:end_a] + fb[end_b:]
    got, _ = try_decode(spliced, CODECS, expect_key=KEY)
    if raw_bytes(a) == raw_bytes(b) or fa == fb:
        return
    assert got is None


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_wrong_expected_key_is_a_miss(codec: str) -> None:
    frame = encode(KEY, make_tensor(1), CODECS[codec])
    with pytest.raises(FrameError, match="key mismatch"):
        decode(frame, CODECS, expect_key=OTHER_KEY)
    assert try_decode(frame, CODECS, expect_key=OTHER_KEY)[0] is None
    assert try_decode(None, CODECS) == (None, "missing")


def _reframe(frame: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """Rewrite the JSON header (valid JSON, wrong content) and fix up its length."""
    start, end = header_span(frame)
    header = json.loads(frame[start:end])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + frame[end:]


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda h: h["__metadata__"].update(dtype="float32"), "shape, dtype|checksum"),
        (lambda h: h["__metadata__"].update(dtype="complex64"), "unknown dtype"),
        (lambda h: h["__metadata__"].update(format="lmcache-core/99"), "unknown frame format"),
        (lambda h: h["__metadata__"].update(checksum="z" * 16), "checksum field"),
        (lambda h: h["__metadata__"].update(checksum="0" * 8), "checksum field"),  # a format-1 CRC32 width
        (lambda h: h["__metadata__"].update(checksum="ABCDEF0123456789"), "checksum field"),
        (lambda h: h["__metadata__"].update(checksum="0" * 16), "checksum mismatch"),
        (lambda h: h["__metadata__"].update(shape="[1e400]"), "malformed"),
        (lambda h: h["__metadata__"].update(shape="[99999999999999999999999, 2]"), "malformed|disagree"),
        (lambda h: h["__metadata__"].update(shape="[-1]"), "malformed"),
        (lambda h: h["__metadata__"].update(shape="[true, 48]"), "malformed"),
        (lambda h: h["__metadata__"].update(codec="zstd"), "checksum|not installed"),
        (lambda h: h["__metadata__"].pop("key"), "wrong fields"),
        (lambda h: h["__metadata__"].update(extra="x"), "wrong fields"),
        (lambda h: h.update(other={}), "wrong fields"),
        (lambda h: h["payload"].update(data_offsets=[1, 2]), "offsets"),
        (lambda h: h["payload"].update(dtype="F16"), "malformed"),
        (lambda h: h.update(__metadata__=[1]), "malformed"),
    ],
)
def test_wrong_headers_are_a_miss(edit, reason: str) -> None:  # type: ignore[no-untyped-def]
    frame = _reframe(encode(KEY, make_tensor(3), RawCodec()), edit)
    with pytest.raises(FrameError, match=reason):
        decode(frame, CODECS, expect_key=KEY)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x00" * 7,
        struct.pack("<Q", 2**40) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 20000) + b"[" * 20000,
        b"\xff" * 64,
    ],
)
def test_garbage_is_a_miss(blob: bytes) -> None:
    with pytest.raises(FrameError):
        decode(blob, CODECS)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (2, 2, 7, 3), (4, 0, 2)])
@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_round_trip(dtype_name: str, shape: tuple[int, ...], codec: str) -> None:
    dtype = DTYPES[dtype_name]
    src = make_tensor(7, shape, torch.float32).to(dtype) if dtype.is_floating_point else make_tensor(7, shape, dtype)
    frame = encode(KEY, src, CODECS[codec])
    got = decode(frame, CODECS, expect_key=KEY)
    assert got.dtype == dtype and tuple(got.shape) == shape
    assert raw_bytes(got) == raw_bytes(src)
    out = torch.empty(shape, dtype=dtype)
    assert decode(frame, CODECS, out=out) is out and raw_bytes(out) == raw_bytes(src)


def test_non_contiguous_input_and_output() -> None:
    src = make_tensor(9, (8, 6), torch.float32).t()
    frame = encode(KEY, src, RawCodec())
    out = torch.empty(8, 6).t()
    decode(frame, CODECS, out=out)
    assert torch.equal(out, src)


def test_out_with_wrong_shape_or_dtype_is_a_miss() -> None:
    frame = encode(KEY, make_tensor(2), RawCodec())
    with pytest.raises(FrameError, match="caller expects"):
        decode(frame, CODECS, out=torch.empty(2, 3, 9, dtype=torch.float16))
    with pytest.raises(FrameError, match="caller expects"):
        decode(frame, CODECS, out=torch.empty(2, 3, 8, dtype=torch.float32))


def test_codec_not_installed_is_a_miss() -> None:
    frame = encode(KEY, make_tensor(2), Lz4Codec())
    with pytest.raises(FrameError, match="not installed"):
        decode(frame, {"raw": RawCodec()})


def test_lz4_actually_compresses() -> None:
    zeros = torch.zeros(64, 1024, dtype=torch.float16)
    assert len(encode(KEY, zeros, Lz4Codec())) < len(encode(KEY, zeros, RawCodec())) // 10


def test_decode_never_uses_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*a: object, **k: object) -> None:
        raise AssertionError("decode used pickle")

    frames = [encode(KEY, make_tensor(4, dtype=d), c) for d in (torch.float16, torch.int64) for c in CODECS.values()]
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    for f in frames:
        assert decode(f, CODECS, expect_key=KEY).numel() == 48
    # A frame whose payload is a pickle stays bytes: nothing in it is executed.
    evil = b"\x80\x04cos\nsystem\n."
    t = torch.frombuffer(bytearray(evil), dtype=torch.uint8)
    assert raw_bytes(decode(encode(KEY, t, RawCodec()), CODECS)) == evil


def test_safetensors_can_open_a_frame(tmp_path: Path) -> None:
    import safetensors
    import safetensors.torch

    src = make_tensor(5, (4, 2, 16, 8), torch.bfloat16)
    frame = encode(KEY, src, RawCodec())
    path = tmp_path / "chunk.safetensors"
    path.write_bytes(frame)
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert list(f.keys()) == ["payload"]
        payload = f.get_tensor("payload")
    assert meta["key"] == str(KEY) and meta["codec"] == "raw" and meta["dtype"] == "bfloat16"
    assert json.loads(meta["shape"]) == [4, 2, 16, 8]
    assert payload.numpy().tobytes() == raw_bytes(src)
    loaded = safetensors.torch.load(frame)
    assert loaded["payload"].numpy().tobytes() == raw_bytes(src)
    info, _, _ = parse_header(frame)
    assert info.shape == (4, 2, 16, 8) and info.raw_len == src.numel() * 2


# -- the public pieces for tiers that move header and payload separately --------------------


@pytest.mark.parametrize("codec", ["raw", "lz4"])
@pytest.mark.parametrize("shape", [(2, 3, 8), (0,), (4096,)])
def test_encode_parts_concatenate_to_encode(codec: str, shape: tuple[int, ...]) -> None:
    t = make_tensor(11, shape)
    header, payload = serde.encode_parts(KEY, t, CODECS[codec])
    frame = encode(KEY, t, CODECS[codec])
    assert header + bytes(payload) == frame
    assert serde.header_span(frame[:8]) == len(header) and len(header) % 8 == 0
    info, meta, offset = serde.parse_header_prefix(header, len(frame))
    assert offset == len(header) and info.key == str(KEY) and info.payload_len == len(payload)
    assert meta == parse_header(frame)[1]
    serde.verify_payload(meta, payload)
    h = serde.payload_hasher(meta)
    for i in range(0, len(payload), 1000):  # any split gives the same digest
        h.update(payload[i : i + 1000])
    assert h.hexdigest() == meta["checksum"] and len(meta["checksum"]) == serde.CHECKSUM_HEX_LEN


def test_frame_header_pieces_rebuild_encode() -> None:
    t = make_tensor(12)
    raw = serde.tensor_bytes(t)
    meta = serde.frame_meta(KEY, t, "raw", raw.nbytes)
    assert "checksum" not in meta and meta["format"] == serde.FRAME_FORMAT == "lmcache-core/2"
    placeholder = serde.frame_header(meta, "0" * 16, raw.nbytes)
    header = serde.frame_header(meta, serde.payload_checksum(meta, raw), raw.nbytes)
    assert len(placeholder) == len(header)  # room can be reserved before hashing
    assert header + bytes(raw) == encode(KEY, t, RawCodec())
    with pytest.raises(ValueError):
        serde.frame_header(meta, "abc", raw.nbytes)


def test_checksum_covers_metadata_and_payload() -> None:
    t = make_tensor(13)
    _, meta, payload = parse_header(encode(KEY, t, RawCodec()))
    with pytest.raises(FrameError, match="checksum mismatch"):
        serde.verify_payload({**meta, "key": str(OTHER_KEY)}, payload)
    with pytest.raises(FrameError, match="checksum mismatch"):
        serde.verify_payload(meta, bytes(payload[:-1]) + bytes([payload[-1] ^ 1]))
    with pytest.raises(FrameError, match="checksum mismatch"):
        serde.verify_payload(meta, bytes(payload) + b"\0")


def test_parse_header_prefix_is_as_strict_as_parse_header() -> None:
    frame = encode(KEY, make_tensor(14), RawCodec())
    span = serde.header_span(frame)
    serde.parse_header_prefix(frame[:span], len(frame))
    serde.parse_header_prefix(frame, len(frame))  # extra bytes are ignored
    for total in (len(frame) - 1, len(frame) + 1, span - 1, 0):
        with pytest.raises(FrameError):
            serde.parse_header_prefix(frame[:span], total)
    with pytest.raises(FrameError, match="only"):
        serde.parse_header_prefix(frame[: span - 1], len(frame))  # caller read too little
    for blob in (b"", b"\x00" * 7, struct.pack("<Q", 2**40) + b"{}"):
        with pytest.raises(FrameError):
            serde.parse_header_prefix(blob, 1 << 20)
    old = frame.replace(b'"format":"lmcache-core/2"', b'"format":"lmcache-core/1"')
    with pytest.raises(FrameError, match="unknown frame format"):
        serde.parse_header_prefix(old, len(old))
