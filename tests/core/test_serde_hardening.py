"""Frame headers are checked before any allocation.

1. A decompression bomb (a small lz4 frame that declares a huge raw size) is refused
   from its header, before a byte is allocated or decompressed: measured in a fresh
   subprocess with ``resource.getrusage`` (peak RSS) and a wall-clock bound, through
   serde and through a real tier (the peer tier's local store), next to a negative
   control that decodes a real 256 MiB frame with the same probe and sees it.
2. Malformed numbers in a header (``Infinity``, ``NaN``, floats, booleans, integers
   beyond 64 bits, exotic digit strings) are a :class:`FrameError` (a miss), never
   ``OverflowError``/``ValueError``/``MemoryError``.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_core.keys import KeyNamespace
from lmcache_core.serde import (
    FrameError,
    Lz4Codec,
    RawCodec,
    decode,
    encode,
    parse_header,
    parse_header_prefix,
    try_decode,
)

CODECS = {"raw": RawCodec(), "lz4": Lz4Codec()}
KEY = KeyNamespace(model="hardening").key(b"\x07" * 16)

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
        tensor, reason = try_decode(frame, codecs, expect_key=key, **kwargs)
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
    tensor, reason = try_decode(frame, codecs, expect_key=key)
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
    frame = encode(KEY, zeros, Lz4Codec())
    assert torch.equal(decode(frame, CODECS, expect_key=KEY), zeros)  # ~254x: accepted
    info, _, _ = parse_header(frame)
    assert info.raw_len / info.payload_len > 250
    _, reason = try_decode(_rewrite(frame, shape=[300 * info.payload_len], raw_len=300 * info.payload_len), CODECS)
    assert reason is not None and "at most 255x" in reason
    raw = encode(KEY, zeros[:64], RawCodec())  # raw: the payload is the data, 1x
    _, reason = try_decode(_rewrite(raw, shape=[200], raw_len=200), CODECS)
    assert reason is not None and "at most 1x" in reason


def test_expected_chunk_is_compared_before_the_payload_is_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``out``, a frame of another shape is refused from its header alone: the
    payload is neither hashed nor decompressed (both would cost time on a bomb)."""
    from lmcache_core import serde

    calls: list[str] = []
    monkeypatch.setattr(serde, "verify_payload", lambda *a: calls.append("hash"))
    monkeypatch.setattr(Lz4Codec, "decode", lambda *a: calls.append("lz4"))
    frame = encode(KEY, torch.ones(64, 64, dtype=torch.float16), Lz4Codec())
    _, reason = try_decode(frame, CODECS, expect_key=KEY, out=torch.empty(32, 64, dtype=torch.float16))
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
    frame = encode(KEY, torch.ones(4, 8, dtype=torch.float16), RawCodec())
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
    assert try_decode(frame, CODECS, out=torch.empty(4, 8, dtype=torch.float16))[0] is None


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
