"""``serde.try_decode`` says which kind of miss a frame is (``Verdict``): OK, MISSING,
WRONG_SHAPE, CORRUPT or FOREIGN, for plain and sealed frames, so that tiers act on the
verdict instead of re-parsing a frame to tell "another shape" from "corrupt".

Each refused frame is built from a frame that the same reader accepts (the negative
control: the untouched frame decodes OK), and the metadata edits that must not look
like damage carry a valid recomputed checksum, so the verdict names the edit and not
a checksum mismatch. The precedence (another key, then another shape, then the rest)
is the one the S3 and Redis tiers always applied when they sorted misses by hand.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from lmcache_core.keys import KeyNamespace
from lmcache_core.serde import (
    Codec,
    Decoded,
    ForeignFrame,
    FrameError,
    FrameSeal,
    Lz4Codec,
    RawCodec,
    SealedCodecs,
    UnknownCodec,
    Verdict,
    WrongShape,
    check_header,
    encode,
    frame_header,
    header_verdict,
    parse_header,
    payload_checksum,
    try_decode,
)

SECRET = "a-deployment-secret-of-32-bytes!"
OTHER_SECRET = "someone-else's-secret-0123456789"
CODECS: dict[str, Codec] = {"raw": RawCodec(), "lz4": Lz4Codec()}
NS = KeyNamespace(model="verdict")
KEY, OTHER_KEY = NS.key(b"\x01" * 16), NS.key(b"\x02" * 16)
DATA = torch.arange(64, dtype=torch.float16).view(8, 8)


def sealed(secret: str = SECRET) -> SealedCodecs:
    return SealedCodecs(CODECS, FrameSeal(secret))


def plain() -> Mapping[str, Codec]:
    return CODECS


def frame_of(codec: str = "raw", codecs: Mapping[str, Codec] = CODECS, data: torch.Tensor = DATA) -> bytes:
    return encode(KEY, data, codecs[codec])


def reframed(frame: bytes, seal: FrameSeal | None = None, payload: bytes | None = None, **fields: Any) -> bytes:
    """``frame`` with metadata fields (and optionally its payload) replaced and a valid
    checksum (a MAC with ``seal``) over the result: only the edit is wrong with it."""
    _, meta, body = parse_header(frame)
    meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in {**meta, **fields}.items() if k != "checksum"}
    payload = bytes(body) if payload is None else payload
    return frame_header(meta, payload_checksum(meta, payload, seal), len(payload)) + payload


def flip_last_byte(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 0x01])


def verdict_of(frame: bytes | None, codecs: Mapping[str, Codec] = CODECS, **kwargs: Any) -> Decoded:
    kwargs.setdefault("expect_key", KEY)
    return try_decode(frame, codecs, **kwargs)


def out_like(data: torch.Tensor = DATA) -> torch.Tensor:
    return torch.empty_like(data)


# -- OK and MISSING ----------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["raw", "lz4"])
@pytest.mark.parametrize("seal", [None, SECRET], ids=["plain", "sealed"])
def test_a_frame_for_the_caller_is_ok(codec: str, seal: str | None) -> None:
    codecs = CODECS if seal is None else sealed(seal)
    frame = frame_of(codec, codecs)
    got = verdict_of(frame, codecs, out=out_like())
    assert got.verdict is Verdict.OK and got.reason is None and torch.equal(got.tensor, DATA)
    no_out = verdict_of(frame, codecs)
    assert no_out.verdict is Verdict.OK and torch.equal(no_out.tensor, DATA)


def test_no_frame_is_missing() -> None:
    got = try_decode(None, CODECS)
    assert got.verdict is Verdict.MISSING and got.tensor is None and got.reason == "missing" and not got.ok


def test_the_answer_names_tensor_reason_and_verdict() -> None:
    """A hit has the tensor and no reason, a miss a reason and no tensor; the answer
    pickles with its verdict."""
    hit = verdict_of(frame_of(), out=out_like())
    assert hit.ok and hit.reason is None and torch.equal(hit.tensor, DATA)
    miss = verdict_of(flip_last_byte(frame_of()), out=out_like())
    assert not miss.ok and miss.tensor is None and miss.reason == "checksum mismatch"
    refused = verdict_of(frame_of(), out=torch.empty(4, 16, dtype=torch.float16))
    assert pickle.loads(pickle.dumps(refused)) == refused and refused.verdict is Verdict.WRONG_SHAPE
    assert "WRONG_SHAPE" in repr(refused)


# -- WRONG_SHAPE -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "out",
    [torch.empty(4, 16, dtype=torch.float16), torch.empty(8, 8, dtype=torch.bfloat16), torch.empty(16, 8, dtype=torch.float16)],
    ids=["same size, other shape", "other dtype", "larger"],
)
@pytest.mark.parametrize("seal", [None, SECRET], ids=["plain", "sealed"])
def test_a_valid_frame_for_another_shape_or_dtype_is_wrong_shape(out: torch.Tensor, seal: str | None) -> None:
    codecs = CODECS if seal is None else sealed(seal)
    frame = frame_of("lz4", codecs)
    assert verdict_of(frame, codecs, out=out_like()).verdict is Verdict.OK  # negative control
    got = verdict_of(frame, codecs, out=out)
    assert got.verdict is Verdict.WRONG_SHAPE and got.tensor is None and "caller expects" in (got.reason or "")


def test_without_out_a_frame_above_the_size_cap_is_wrong_shape() -> None:
    frame = frame_of()
    assert verdict_of(frame, max_raw_bytes=DATA.nbytes).verdict is Verdict.OK
    assert verdict_of(frame, max_raw_bytes=DATA.nbytes - 1).verdict is Verdict.WRONG_SHAPE


def test_wrong_shape_is_decided_from_the_header_before_the_payload_and_seal() -> None:
    """The caller cannot take a frame of another shape whatever else is wrong with it:
    a flipped payload byte or another deployment's seal does not change that verdict
    (the payload is never hashed for it). With the caller's shape, both are refused
    for what they are."""
    other_shape = torch.empty(4, 16, dtype=torch.float16)
    flipped = flip_last_byte(frame_of())
    assert verdict_of(flipped, out=other_shape).verdict is Verdict.WRONG_SHAPE
    assert verdict_of(flipped, out=out_like()).verdict is Verdict.CORRUPT
    theirs = frame_of("raw", sealed(OTHER_SECRET))
    assert verdict_of(theirs, sealed(), out=other_shape).verdict is Verdict.WRONG_SHAPE
    assert verdict_of(theirs, sealed(), out=out_like()).verdict is Verdict.FOREIGN


# -- CORRUPT -----------------------------------------------------------------------------
BIG = torch.zeros(64, 1024, dtype=torch.float16)


def _ratio_bomb() -> bytes:
    """An lz4 frame of ``BIG``'s shape with a valid checksum over a 100-byte payload:
    more raw bytes than lz4 can expand 100 bytes to (255x)."""
    return reframed(encode(KEY, BIG, Lz4Codec()), payload=b"\0" * 100)


def _edit_without_checksum(frame: bytes, **fields: str) -> bytes:
    """``frame`` with metadata fields replaced and the old checksum kept."""
    _, meta, body = parse_header(frame)
    meta = {**meta, **fields}
    return frame_header(meta, meta["checksum"], len(body)) + bytes(body)


CORRUPT: dict[str, Callable[[], bytes]] = {
    "payload byte flipped": lambda: flip_last_byte(frame_of()),
    "lz4 payload byte flipped": lambda: flip_last_byte(frame_of("lz4")),
    "truncated payload": lambda: frame_of()[:-7],
    "shorter than the length prefix": lambda: frame_of()[:5],
    "header cut short": lambda: frame_of()[:40],
    "garbage": lambda: b"\x00garbage" * 50,
    "empty": lambda: b"",
    "huge header length": lambda: struct.pack("<Q", 2**62) + frame_of()[8:],
    "header is not JSON": lambda: frame_of()[:8] + b"[" + frame_of()[9:],
    "metadata edited, checksum not": lambda: _edit_without_checksum(frame_of(), codec="lz4"),
    "lengths disagree": lambda: reframed(frame_of(), raw_len="100"),
    "payload lz4 cannot decode": lambda: reframed(frame_of("lz4"), payload=b"\xff" * 40),
    "decompression bomb": _ratio_bomb,
}


@pytest.mark.parametrize("damage", list(CORRUPT))
def test_damaged_frames_are_corrupt(damage: str) -> None:
    assert verdict_of(frame_of(), out=out_like()).verdict is Verdict.OK  # negative control
    bad = CORRUPT[damage]()
    out = torch.empty_like(BIG) if damage == "decompression bomb" else out_like()
    for kwargs in ({"out": out}, {}):
        got = verdict_of(bad, **kwargs)
        assert got.verdict is Verdict.CORRUPT, (damage, kwargs, got.reason)
        assert got.tensor is None and got.reason


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_a_sealed_frame_with_a_flipped_byte_is_corrupt_not_foreign(codec: str) -> None:
    codecs = sealed()
    frame = frame_of(codec, codecs)
    assert verdict_of(frame, codecs, out=out_like()).verdict is Verdict.OK
    got = verdict_of(flip_last_byte(frame), codecs, out=out_like())
    assert got.verdict is Verdict.CORRUPT and got.reason == "MAC mismatch: not written with our frame_secret"


# -- FOREIGN -----------------------------------------------------------------------------
Reader = Callable[[], Mapping[str, Codec]]
#: case -> (the frame, its reader, the header check's error, a control frame and reader
#: that decode OK: the unedited frame, or the same frame for the reader that wrote it)
FOREIGN: dict[str, tuple[Callable[[], bytes], Reader, type[FrameError] | None, Callable[[], bytes], Reader]] = {
    "another frame format": (lambda: reframed(frame_of(), format="lmcache-core/1"), plain, None, frame_of, plain),
    "a dtype this build lacks": (lambda: reframed(frame_of(), dtype="float4_e2m1"), plain, None, frame_of, plain),
    "a codec not installed here": (
        lambda: frame_of("lz4"),
        lambda: {"raw": RawCodec()},
        UnknownCodec,
        lambda: frame_of("lz4"),
        plain,
    ),
    "sealed with another key id": (
        lambda: frame_of("raw", sealed(OTHER_SECRET)),
        sealed,
        ForeignFrame,
        lambda: frame_of("raw", sealed(OTHER_SECRET)),
        lambda: sealed(OTHER_SECRET),
    ),
    "unsealed, for a sealed reader": (frame_of, sealed, ForeignFrame, frame_of, plain),
    "sealed, for a reader without a secret": (
        lambda: frame_of("raw", sealed()),
        plain,
        ForeignFrame,
        lambda: frame_of("raw", sealed()),
        sealed,
    ),
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_frames_that_are_not_this_readers_are_foreign(case: str) -> None:
    make, reader, error, control, control_reader = FOREIGN[case]
    codecs = reader()
    assert verdict_of(control(), control_reader(), out=out_like()).verdict is Verdict.OK  # negative control
    frame = make()
    for kwargs in ({"out": out_like()}, {}):
        got = verdict_of(frame, codecs, **kwargs)
        assert got.verdict is Verdict.FOREIGN, (case, got.reason)
    if error is not None:  # the others are refused by the parser, before check_header
        info, meta, _ = parse_header(frame)
        with pytest.raises(error) as raised:
            check_header(info, meta, codecs, expect_key=KEY, out=out_like())
        assert raised.value.verdict is Verdict.FOREIGN


@pytest.mark.parametrize("seal", [None, SECRET], ids=["plain", "sealed"])
def test_another_keys_frame_is_foreign_whatever_its_shape(seal: str | None) -> None:
    codecs = CODECS if seal is None else sealed(seal)
    frame = encode(OTHER_KEY, DATA, codecs["raw"])
    assert verdict_of(frame, codecs, expect_key=OTHER_KEY, out=out_like()).verdict is Verdict.OK
    for out in (out_like(), torch.empty(4, 16, dtype=torch.float16)):
        got = verdict_of(frame, codecs, out=out)
        assert got.verdict is Verdict.FOREIGN and "key mismatch" in (got.reason or "")


# -- from the header alone ---------------------------------------------------------------
def test_header_checks_raise_what_try_decode_reports() -> None:
    """``check_header`` (for tiers that read the header themselves) raises the
    FrameError subclass whose verdict ``try_decode`` gives for the same frame."""
    frame = frame_of("lz4")
    info, meta, _ = parse_header(frame)
    check_header(info, meta, CODECS, expect_key=KEY, out=out_like())  # negative control: passes
    cases: list[tuple[dict[str, Any], Mapping[str, Codec], type[FrameError]]] = [
        ({"out": torch.empty(4, 16, dtype=torch.float16)}, CODECS, WrongShape),
        ({"expect_key": OTHER_KEY}, CODECS, ForeignFrame),
        ({}, {"raw": RawCodec()}, UnknownCodec),
        ({}, sealed(), ForeignFrame),
    ]
    for kwargs, codecs, error in cases:
        kwargs = {"expect_key": KEY, "out": out_like(), **kwargs}
        with pytest.raises(error) as raised:
            check_header(info, meta, codecs, **kwargs)
        assert raised.value.verdict is try_decode(frame, codecs, **kwargs).verdict is error.verdict


def test_header_verdict_judges_a_bounded_prefix() -> None:
    """A tier that read only the first bytes of a long value (Redis) gets the verdict
    from the header: another shape, another key, damage, or OK (payload unchecked)."""
    big = torch.zeros(64, 1024, dtype=torch.float16)
    frame = encode(KEY, big, RawCodec())
    head = frame[:4096]
    small = out_like()
    assert header_verdict(head, len(frame), CODECS, expect_key=KEY, out=small) is Verdict.WRONG_SHAPE
    assert header_verdict(head, len(frame), CODECS, expect_key=KEY, out=torch.empty_like(big)) is Verdict.OK
    assert header_verdict(head, len(frame), CODECS, expect_key=OTHER_KEY, out=small) is Verdict.FOREIGN
    assert header_verdict(head, len(frame), sealed(), expect_key=KEY, out=torch.empty_like(big)) is Verdict.FOREIGN
    assert header_verdict(head, len(frame) + 1, CODECS, expect_key=KEY, out=small) is Verdict.CORRUPT
    assert header_verdict(b"\x00" * 4096, 1 << 20, CODECS, expect_key=KEY, out=small) is Verdict.CORRUPT
