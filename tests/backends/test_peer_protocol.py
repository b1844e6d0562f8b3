"""The peer wire format and config parsing: round trips, strict rejection, and a
fuzzed decoder that raises nothing but ProtocolError."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_backend_peer import protocol as p
from lmcache_backend_peer.config import PeerConfig, load_secret, parse_address
from lmcache_backend_peer.factory import create_peer_backend
from lmcache_core.config import ConfigError, validate_section
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context

MAX = 1 << 20


def _keys(n: int) -> list:
    ns = KeyNamespace(model="proto")
    return [ns.key(bytes([i % 256]) * 16) for i in range(n)]


def _valid_messages() -> list[bytes]:
    keys = _keys(3)
    return [
        p.encode_message(p.CHALLENGE, 0, [os.urandom(32), os.urandom(16)]),
        p.encode_message(p.AUTH, 0, [os.urandom(32), os.urandom(32)]),
        p.encode_message(p.AUTH_OK, 0, [os.urandom(32)]),
        p.encode_message(p.LOOKUP, 7, [p.encode_keys(keys)]),
        p.encode_message(p.GET, 8, [p.encode_keys(keys)]),
        p.encode_message(p.REMOVE, 9, [p.encode_keys(keys[:1])]),
        p.encode_message(p.LOOKUP_OK, 7, [p.u32(2)]),
        p.encode_message(p.GET_OK, 8, p.encode_get_reply_parts([b"frame-one", None, b"x" * 100])),
        p.encode_message(p.PUT, 10, [p.key_bytes(keys[0]), b"some frame bytes"]),
        p.encode_message(p.PUT_OK, 10, [b"\x01"]),
        p.encode_message(p.REMOVE_OK, 9, [p.u32(1)]),
        p.encode_message(p.ERROR, 11, [b"nope"]),
    ]


VALID = _valid_messages()


def test_round_trips() -> None:
    keys = _keys(5)
    h, body = p.parse_message(p.encode_message(p.GET, 42, [p.encode_keys(keys)]), MAX)
    assert (h.type, h.request_id) == (p.GET, 42)
    assert isinstance(body, p.KeysRequest) and body.keys == keys
    _, reply = p.parse_message(p.encode_message(p.GET_OK, 1, p.encode_get_reply_parts([b"abc", None, b"de"])), MAX)
    assert isinstance(reply, p.GetReply)
    assert [bytes(f) if f is not None else None for f in reply.frames] == [b"abc", None, b"de"]
    _, put = p.parse_message(p.encode_message(p.PUT, 2, [p.key_bytes(keys[1]), b"frame"]), MAX)
    assert isinstance(put, p.PutRequest) and put.key == keys[1] and bytes(put.frame) == b"frame"
    _, cnt = p.parse_message(VALID[6], MAX)
    assert cnt == p.Count(2)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: b"XXXX" + m[4:], "magic"),
        (lambda m: m[:4] + bytes([9]) + m[5:], "version"),
        (lambda m: m[:5] + bytes([200]) + m[6:], "type"),
        (lambda m: m[:6] + b"\x00\x01" + m[8:], "flags"),
        (lambda m: m[:-1], "header says"),
        (lambda m: m + b"\x00", "header says"),
    ],
)
def test_rejects_bad_headers(mutate, match: str) -> None:
    with pytest.raises(p.ProtocolError, match=match):
        p.parse_message(mutate(VALID[3]), MAX)


def test_body_limit_is_checked_before_reading() -> None:
    header = p.pack_header(p.GET_OK, 1, 1 << 40)
    with pytest.raises(p.ProtocolError, match="exceeds the limit"):
        p.decode_header(header, MAX)


def test_rejects_bad_bodies() -> None:
    with pytest.raises(p.ProtocolError, match="more than"):
        p.parse_body(p.LOOKUP, struct.pack(">I", p.MAX_KEYS_PER_MESSAGE + 1))
    with pytest.raises(p.ProtocolError, match="must be"):
        p.parse_body(p.LOOKUP, struct.pack(">I", 2) + b"\x00" * 32)
    with pytest.raises(p.ProtocolError, match="past the end"):
        p.parse_body(p.GET_OK, struct.pack(">IQ", 1, 10) + b"abc")
    with pytest.raises(p.ProtocolError, match="trailing"):
        p.parse_body(p.GET_OK, struct.pack(">IQ", 1, 3) + b"abcd")
    with pytest.raises(p.ProtocolError, match="no frame"):
        p.parse_body(p.PUT, b"\x00" * 32)
    with pytest.raises(p.ProtocolError, match="status"):
        p.parse_body(p.PUT_OK, b"\x02")


def _decode_only_protocol_errors(data: bytes) -> None:
    try:
        p.parse_message(data, MAX)
    except p.ProtocolError:
        pass


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_only_protocol_errors(data)


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_body_behind_valid_header(body: bytes) -> None:
    for mtype in p.TYPE_NAMES:
        _decode_only_protocol_errors(p.pack_header(mtype, 1, len(body)) + body)


@settings(max_examples=800, deadline=None)
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_fuzz_mutated_valid_messages(msg: bytes, flips: list[tuple[int, int]]) -> None:
    data = bytearray(msg)
    for pos, val in flips:
        data[pos % len(data)] = val
    _decode_only_protocol_errors(bytes(data))


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID), st.integers(0, 10_000), st.binary(max_size=40))
def test_fuzz_truncated_and_extended(msg: bytes, cut: int, tail: bytes) -> None:
    _decode_only_protocol_errors(msg[: cut % (len(msg) + 1)])
    _decode_only_protocol_errors(msg + tail)
    _decode_only_protocol_errors(msg[: cut % (len(msg) + 1)] + tail)


# -- addresses and config ---------------------------------------------------------------
def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_address("cache-node.local:1") == ("cache-node.local", 1)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    assert parse_address("0.0.0.0:0", allow_port_zero=True) == ("0.0.0.0", 0)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("localhost", "host:port"),
        (":9000", "host:port"),
        ("host:http", "port must be a number"),
        ("host:70000", "port must be in"),
        ("host:0", "port must be in 1"),
        ("::1:9000", "brackets"),
        ("[::1]9000", r"\[ipv6\]:port"),
        (9000, "host:port"),
    ],
)
def test_parse_address_errors(bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_address(bad)


def _err(section: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_section(PeerConfig, section, "backends[1]", "cfg.yaml")
    return str(info.value)


def test_config_errors_name_key_and_source() -> None:
    msg = _err({"peers": ["10.0.0.1:9000", "nope"], "secret": "s" * 16})
    assert "backends[1].peers[1]" in msg and "host:port" in msg and "cfg.yaml" in msg
    msg = _err({"peers": ["a:1"]})
    assert "backends[1]" in msg and "exactly one of secret or secret_file" in msg
    msg = _err({"peers": ["a:1"], "secret": "s" * 16, "secret_file": "/x"})
    assert "exactly one" in msg
    assert "listen" in _err({"secret": "s" * 16})
    msg = _err({"peers": ["a:1"], "secret": "s" * 16, "timeout_s": 0.0})
    assert "backends[1].timeout_s" in msg
    msg = _err({"peers": ["a:1"], "secret": "s" * 16, "max_size": "lots"})
    assert "backends[1].max_size" in msg
    msg = _err({"peers": ["a:1"], "secret": "s" * 16, "listne": "a:1"})
    assert "backends[1].listne: unknown key" in msg
    assert "listen" in _err({"listen": "127.0.0.1", "secret": "s" * 16})


def test_secret_file(tmp_path) -> None:
    f = tmp_path / "secret"
    f.write_text("top-secret-0123456789\n")
    cfg = validate_section(PeerConfig, {"peers": ["a:1"], "secret_file": str(f)}, "b", "t")
    assert load_secret(cfg, "b", "t") == b"top-secret-0123456789"
    f.write_text("\n")
    with pytest.raises(ConfigError, match=r"b\.secret_file: .* is empty"):
        load_secret(cfg, "b", "t")
    cfg = validate_section(PeerConfig, {"peers": ["a:1"], "secret_file": str(tmp_path / "missing")}, "b", "t")
    with pytest.raises(ConfigError, match=r"b\.secret_file: cannot read"):
        load_secret(cfg, "b", "t")


def test_secret_is_not_in_the_repr() -> None:
    cfg = validate_section(PeerConfig, {"peers": ["a:1"], "secret": "hunter2-hunter2-hunter2"}, "b", "t")
    assert "hunter2" not in repr(cfg)


def test_listen_on_a_busy_port_is_a_config_error() -> None:
    ctx = make_context(key_path="backends[1]")
    first = create_peer_backend({"listen": "127.0.0.1:0", "secret": "s" * 16}, ctx)
    try:
        host, port = first.server.address
        with pytest.raises(ConfigError, match=r"backends\[1\]\.listen: cannot listen"):
            create_peer_backend({"listen": f"{host}:{port}", "secret": "s" * 16}, ctx)
    finally:
        first.close()
