"""The frame format: a changed frame never decodes to different data (flipped bytes,
truncation, appended bytes, another frame's header, a wrong expected key, edited
headers and garbage are misses); round trips across dtypes, shapes and codecs; no
pickle; safetensors can read a frame; the pieces for tiers that move header and
payload separately rebuild the same frame.

A header is checked before anything is allocated or decompressed: a small lz4 frame
declaring a huge raw size (a decompression bomb), or more than the codec can expand
to, is refused from its header (peak RSS and wall clock measured in a fresh
subprocess, through serde and through a real tier, next to a negative control that
decodes a real 256 MiB frame with the same probe and sees it); the expected chunk is
compared before the payload is hashed. Malformed numbers in a header (``Infinity``,
``NaN``, floats, booleans, integers beyond 64 bits, exotic digit strings), and any
JSON value in a numeric field, are a :class:`FrameError` (a miss) or a valid frame,
never ``OverflowError``/``ValueError``/``MemoryError``."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_core import serde
from lmcache_core.keys import KeyNamespace
from lmcache_core.serde import (
    DTYPES,
    Decoded,
    FrameError,
    Lz4Codec,
    RawCodec,
    decode,
    encode,
    parse_header,
    parse_header_prefix,
    try_decode,
    Verdict,
)

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
    decoded = try_decode(frame, CODECS, expect_key=KEY)
    got, reason = decoded.tensor, decoded.reason
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
    got = try_decode(bytes(bad), CODECS, expect_key=KEY).tensor
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
    decoded = try_decode(frame[:cut], CODECS, expect_key=KEY)
    got, reason = decoded.tensor, decoded.reason
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
    got = try_decode(spliced, CODECS, expect_key=KEY).tensor
    if raw_bytes(a) == raw_bytes(b) or fa == fb:
        return
    assert got is None


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_wrong_expected_key_is_a_miss(codec: str) -> None:
    frame = encode(KEY, make_tensor(1), CODECS[codec])
    with pytest.raises(FrameError, match="key mismatch"):
        decode(frame, CODECS, expect_key=OTHER_KEY)
    assert try_decode(frame, CODECS, expect_key=OTHER_KEY).tensor is None
    assert try_decode(None, CODECS) == Decoded(None, "missing", Verdict.MISSING)


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


# -- headers checked before any allocation -----------------------------------------------


HEADER_KEY = KeyNamespace(model="hardening").key(b"\x07" * 16)

# -- decompression bomb --------------------------------------------------------------------
BOMB_CHILD = textwrap.dedent(
    """
    import json, os, resource, sys, time
    import torch
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.serde import Lz4Codec, RawCodec, encode, frame_header, frame_meta, payload_checksum, try_decode

    def rss_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def current_rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    codecs = {"raw": RawCodec(), "lz4": Lz4Codec()}
    key = KeyNamespace(model="hardening").key(b"\\x07" * 16)
    # 8 MiB lz4 payload whose header claims 4 GiB of float16 (shape [2**31]), with a
    # valid checksum: anyone can compute XXH3, so the checksum is no defence.
    payload = os.urandom(8 << 20)
    meta = frame_meta(key, torch.empty(0, dtype=torch.float16), "lz4", 4 << 30)
    meta["shape"] = json.dumps([2**31])
    bomb = frame_header(meta, payload_checksum(meta, payload), len(payload)) + payload
    # A bomb within lz4's real ratio (255x) when no `out` is given: 1.9 GiB declared.
    meta2 = dict(meta, shape=json.dumps([950 << 20]), raw_len=str(1900 << 20))
    bomb2 = frame_header(meta2, payload_checksum(meta2, payload), len(payload)) + payload
    out = torch.empty(4, 1024, dtype=torch.float16)  # the chunk the caller expects
    res = {}
    base = rss_mib()
    for name, frame, kwargs in (
        ("with_out", bomb, {"out": out}),
        ("no_out", bomb, {}),
        ("no_out_within_ratio", bomb2, {}),
    ):
        t0 = time.perf_counter()
        decoded = try_decode(frame, codecs, expect_key=key, **kwargs)
        tensor, reason = decoded.tensor, decoded.reason
        res[name] = {"s": time.perf_counter() - t0, "reason": reason, "decoded": tensor is not None}
    # The same frame through a real tier: the peer tier's local store (as a frame
    # fetched from a peer would be), then its get into the caller's chunk.
    from lmcache_backend_peer import create_peer_backend
    from lmcache_core.testing import make_context
    peer = create_peer_backend({"listen": "127.0.0.1:0", "secret": "x" * 32, "max_size": "64MiB"}, make_context())
    try:
        peer.store.put_frame(key, bomb)
        t0 = time.perf_counter()
        ok = peer.get(key, out)
        res["peer_get"] = {"s": time.perf_counter() - t0, "hit": ok}
    finally:
        peer.close()
    res["bomb_rss_growth_mib"] = rss_mib() - base
    # Negative control: a real 256 MiB frame (lz4 of zeros, ~1 MiB) decoded with the
    # same probe must show its allocation, or the probe could not see a bomb either.
    big = torch.zeros(128 << 20, dtype=torch.float16)
    frame = encode(key, big, codecs["lz4"])
    del big
    res["control_frame_mib"] = len(frame) / 2**20
    # Current (not peak) RSS while the decoded tensor is alive: building the control
    # frame may already have set the peak, and the allocator may reuse those pages.
    before = current_rss_mib()
    decoded = try_decode(frame, codecs, expect_key=key)
    tensor, reason = decoded.tensor, decoded.reason
    res["control_rss_growth_mib"] = current_rss_mib() - before
    res["control_ok"] = reason is None and tensor.numel() == 128 << 20
    print(json.dumps(res))
    """
)


def test_decompression_bomb_is_refused_before_allocation() -> None:
    """Figures: a 8 MiB frame declaring 4 GiB costs < 64 MiB peak RSS and < 0.5 s per
    read, with and without an expected chunk and through the peer tier; the same
    probe sees >= 200 MiB for a genuine 256 MiB frame (negative control)."""
    proc = subprocess.run([sys.executable, "-c", BOMB_CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    assert not res["with_out"]["decoded"] and "caller expects" in res["with_out"]["reason"]
    assert not res["no_out"]["decoded"] and "more than" in res["no_out"]["reason"]
    assert not res["no_out_within_ratio"]["decoded"] and "allowed" in res["no_out_within_ratio"]["reason"]
    assert res["peer_get"]["hit"] is False
    for name in ("with_out", "no_out", "no_out_within_ratio", "peer_get"):
        assert res[name]["s"] < 0.5, (name, res[name])
    assert res["bomb_rss_growth_mib"] < 64, res
    assert res["control_ok"] and res["control_frame_mib"] < 4
    assert res["control_rss_growth_mib"] >= 200, res


def test_lz4_header_claiming_more_than_the_codec_can_expand_is_refused() -> None:
    """A raw size above 255x the payload (lz4's ceiling) is refused even when it is
    below the no-``out`` cap; a genuine maximal-ratio frame (zeros) still decodes."""
    zeros = torch.zeros(1 << 20, dtype=torch.uint8)
    frame = encode(HEADER_KEY, zeros, Lz4Codec())
    assert torch.equal(decode(frame, CODECS, expect_key=HEADER_KEY), zeros)  # ~254x: accepted
    info, _, _ = parse_header(frame)
    assert info.raw_len / info.payload_len > 250
    reason = try_decode(_rewrite(frame, shape=[300 * info.payload_len], raw_len=300 * info.payload_len), CODECS).reason
    assert reason is not None and "at most 255x" in reason
    raw = encode(HEADER_KEY, zeros[:64], RawCodec())  # raw: the payload is the data, 1x
    reason = try_decode(_rewrite(raw, shape=[200], raw_len=200), CODECS).reason
    assert reason is not None and "at most 1x" in reason


def test_expected_chunk_is_compared_before_the_payload_is_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``out``, a frame of another shape is refused from its header alone: the
    payload is neither hashed nor decompressed (both would cost time on a bomb)."""
    from lmcache_core import serde

    calls: list[str] = []
    monkeypatch.setattr(serde, "verify_payload", lambda *a: calls.append("hash"))
    monkeypatch.setattr(Lz4Codec, "decode", lambda *a: calls.append("lz4"))
    frame = encode(HEADER_KEY, torch.ones(64, 64, dtype=torch.float16), Lz4Codec())
    reason = try_decode(frame, CODECS, expect_key=HEADER_KEY, out=torch.empty(32, 64, dtype=torch.float16)).reason
    assert reason is not None and "caller expects" in reason and calls == []


# -- malformed numbers ---------------------------------------------------------------------
def _rewrite(frame: bytes, *, header_text: str | None = None, **meta: Any) -> bytes:
    """``frame`` with metadata fields replaced (JSON-encoded where not strings) and
    its header length fixed up; or with ``header_text`` as the whole header."""
    (hlen,) = struct.unpack_from("<Q", frame)
    payload = frame[8 + hlen :]
    if header_text is None:
        header = json.loads(frame[8 : 8 + hlen])
        for k, v in meta.items():
            header["__metadata__"][k] = v if isinstance(v, str) else json.dumps(v)
        header_text = json.dumps(header)
    body = header_text.encode()
    return struct.pack("<Q", len(body)) + body + payload


def _base() -> tuple[bytes, dict[str, Any]]:
    frame = encode(HEADER_KEY, torch.ones(4, 8, dtype=torch.float16), RawCodec())
    (hlen,) = struct.unpack_from("<Q", frame)
    return frame, json.loads(frame[8 : 8 + hlen])


def _with_offsets(text: str) -> bytes:
    frame, header = _base()
    header_text = json.dumps(header).replace(json.dumps(header["payload"]["data_offsets"]), text)
    return _rewrite(frame, header_text=header_text)


MALFORMED = {
    "offsets Infinity": lambda: _with_offsets("[0, Infinity]"),
    "offsets -Infinity": lambda: _with_offsets("[-Infinity, 64]"),
    "offsets NaN": lambda: _with_offsets("[NaN, 64]"),
    "offsets 1e400": lambda: _with_offsets("[0, 1e400]"),
    "offsets float": lambda: _with_offsets("[0, 64.0]"),
    "offsets bool": lambda: _with_offsets("[false, 64]"),
    "offsets 2**64": lambda: _with_offsets(f"[0, {2**64 + 64}]"),
    "offsets 2**200": lambda: _with_offsets(f"[{2**200}, {2**200 + 64}]"),
    "offsets 4000 digits": lambda: _with_offsets(f"[0, {'9' * 4000}]"),
    "offsets string": lambda: _with_offsets('[0, "64"]'),
    "offsets null": lambda: _with_offsets("null"),
    "shape Infinity": lambda: _rewrite(_base()[0], shape="[Infinity, 8]"),
    "shape 2**70": lambda: _rewrite(_base()[0], shape=f"[{2**70}, 0]"),
    "shape float": lambda: _rewrite(_base()[0], shape="[4.0, 8]"),
    "shape object": lambda: _rewrite(_base()[0], shape='{"a": 1}'),
    "shape nested": lambda: _rewrite(_base()[0], shape="[[4], 8]"),
    "raw_len exponent": lambda: _rewrite(_base()[0], raw_len="6.4e1"),
    "raw_len 2**70": lambda: _rewrite(_base()[0], raw_len=str(2**70)),
    "raw_len 5000 digits": lambda: _rewrite(_base()[0], raw_len="9" * 5000),
    "raw_len signed": lambda: _rewrite(_base()[0], raw_len="+64"),
    "raw_len unicode digits": lambda: _rewrite(_base()[0], raw_len="\u0666\u0664"),
    "raw_len spaces": lambda: _rewrite(_base()[0], raw_len=" 64"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_numbers_in_a_header_are_a_miss(name: str) -> None:
    frame = MALFORMED[name]()
    for parse in (parse_header, lambda f: parse_header_prefix(f, len(f)), lambda f: decode(f, CODECS)):
        with pytest.raises(FrameError):
            parse(frame)
    assert try_decode(frame, CODECS, out=torch.empty(4, 8, dtype=torch.float16)).tensor is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["offsets", "shape", "raw_len", "payload_shape"]), value=json_values)
def test_any_json_value_in_a_numeric_field_is_a_miss_or_valid(field: str, value: Any) -> None:
    """Whatever JSON sits in a numeric field, parsing raises FrameError or succeeds;
    never another exception."""
    frame, header = _base()
    if field == "offsets":
        header["payload"]["data_offsets"] = [0, value]
    elif field == "payload_shape":
        header["payload"]["shape"] = value
    else:
        header["__metadata__"][field] = value if isinstance(value, str) else json.dumps(value)
    text = json.dumps(header)  # allow_nan: writes Infinity/NaN as a hostile writer would
    bad = _rewrite(frame, header_text=text)
    try:
        decode(bad, CODECS)
    except FrameError:
        pass
