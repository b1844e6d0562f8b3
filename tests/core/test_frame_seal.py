"""Sealed frames (``frame_secret``): a keyed BLAKE3 MAC over key, header and payload,
so a client of a shared store without the secret cannot plant KV that is served.

Without a secret, a frame planted in a shared store with a recomputed plain checksum
is served as a hit (666.0 instead of the real KV): the negative control shows it."""

from __future__ import annotations

import ast
import hmac
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.config import ConfigError, load_config, read_frame_secret
from lmcache_core import serde
from lmcache_core.plugins import PluginManager
from lmcache_core.serde import (
    MAC_HEX_LEN,
    FrameError,
    FrameSeal,
    Lz4Codec,
    RawCodec,
    SealedCodec,
    SealedCodecs,
    checksum_placeholder,
    decode,
    encode,
    frame_header,
    frame_meta,
    parse_header,
    payload_hasher,
    seal_of,
    try_decode,
)
from lmcache_core.testing import MemoryTierPlugin, random_chunk, random_key
from lmcache_core.testing.tokens import retrieve_tokens, store_tokens, token_hashes

SECRET = "a-deployment-secret-of-32-bytes!"
OTHER = "someone-else's-secret-0123456789"
CODECS = {"raw": RawCodec(), "lz4": Lz4Codec()}


def sealed_codecs(secret: str = SECRET) -> SealedCodecs:
    return SealedCodecs(CODECS, FrameSeal(secret))


# -- the key -------------------------------------------------------------------


def test_seal_needs_a_real_secret_and_never_shows_it() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        FrameSeal("short")
    a, b, c = FrameSeal(SECRET), FrameSeal(SECRET), FrameSeal(OTHER)
    assert a == b and a.key_id == b.key_id and a.key_id != c.key_id
    assert len(a.key_id) == 16 and SECRET not in repr(a) and a.key_id in repr(a)


# -- frames --------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_sealed_frame_round_trips_and_carries_a_mac(codec: str) -> None:
    codecs = sealed_codecs()
    key, data = random_key(), random_chunk(seed=1)
    frame = encode(key, data, codecs[codec])
    _, meta, _ = parse_header(frame)
    assert meta["auth"] == FrameSeal(SECRET).key_id and len(meta["checksum"]) == MAC_HEX_LEN
    out = torch.empty_like(data)
    assert torch.equal(decode(frame, codecs, expect_key=key, out=out), data)


def test_a_plain_frame_with_a_valid_checksum_is_refused_by_a_sealed_reader() -> None:
    key, real = random_key(), random_chunk(seed=2)
    planted = encode(key, torch.full_like(real, 666.0), RawCodec())
    # negative control: a plain reader takes it (the attack on an unsealed deployment)
    decoded = try_decode(planted, CODECS, expect_key=key, out=torch.empty_like(real))
    got, reason = decoded.tensor, decoded.reason
    assert reason is None and got is not None and float(got.flatten()[0]) == 666.0
    decoded = try_decode(planted, sealed_codecs(), expect_key=key, out=torch.empty_like(real))
    got, reason = decoded.tensor, decoded.reason
    assert got is None and reason is not None and "not sealed" in reason


def test_frames_sealed_with_another_key_are_refused_and_named() -> None:
    key, data = random_key(), random_chunk(seed=3)
    frame = encode(key, data, RawCodec(), seal=FrameSeal(OTHER))
    reason = try_decode(frame, sealed_codecs(), expect_key=key, out=torch.empty_like(data)).reason
    assert reason is not None and "another key" in reason and FrameSeal(OTHER).key_id in reason


def test_a_plain_reader_refuses_sealed_frames_with_a_clear_reason() -> None:
    key, data = random_key(), random_chunk(seed=4)
    frame = encode(key, data, sealed_codecs()["raw"])
    reason = try_decode(frame, CODECS, expect_key=key, out=torch.empty_like(data)).reason
    assert reason is not None and "no frame_secret" in reason


def _rewrite_header(frame: bytes, **changes: Any) -> bytes:
    """``frame`` with metadata fields changed and the MAC left as it was (what an
    attacker without the key can do), padded back to the header's length."""
    _, meta, payload = parse_header(frame)
    hlen = int.from_bytes(frame[:8], "little")
    doc = json.loads(frame[8 : 8 + hlen])
    doc["__metadata__"].update(changes)
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + bytes(payload)


def test_every_byte_is_covered_by_the_mac() -> None:
    key, data = random_key(), random_chunk(shape=(4, 8), seed=5)
    codecs = sealed_codecs()
    frame = bytearray(encode(key, data, codecs["raw"]))
    assert decode(bytes(frame), codecs, expect_key=key).equal(data)  # negative control: intact
    damaged = bytearray(frame)
    damaged[-1] ^= 1
    with pytest.raises(FrameError, match="MAC mismatch"):
        decode(bytes(damaged), codecs, expect_key=key)
    other = KeyNamespace(model="other").key(key.chunk_hash)
    for changes in ({"key": other.to_str()}, {"shape": json.dumps([8, 4])}, {"codec": "lz4"}):
        with pytest.raises(FrameError):
            decode(_rewrite_header(bytes(frame), **changes), codecs, expect_key=None)
    # the checksum field holds a MAC: a recomputed plain checksum is malformed there
    _, meta, payload = parse_header(bytes(frame))
    with pytest.raises(FrameError, match="checksum field is malformed"):
        decode(_rewrite_header(bytes(frame), checksum="0" * 16), codecs)


def test_streaming_hasher_and_placeholder_match_encode() -> None:
    seal = FrameSeal(SECRET)
    key, data = random_key(), random_chunk(seed=6)
    meta = frame_meta(key, data, "raw", data.nbytes, seal=seal)
    placeholder = checksum_placeholder(meta)
    assert len(placeholder) == MAC_HEX_LEN
    h = payload_hasher(meta, seal)
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
    h.update(raw[:1000])
    h.update(raw[1000:])
    header = frame_header(meta, h.hexdigest(), len(raw))
    assert len(header) == len(frame_header(meta, placeholder, len(raw)))
    assert header + raw == encode(key, data, RawCodec(), seal=seal)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        frame_header(meta, "0" * 16, len(raw))


def test_a_tiers_plain_copy_of_the_codecs_keeps_the_seal() -> None:
    """Tiers copy ``ctx.codecs`` into a dict of their own (the example backend does):
    the seal must survive that, or the tier would refuse its own frames."""
    codecs = sealed_codecs()
    copy = dict(codecs)
    assert seal_of(copy) == FrameSeal(SECRET) and seal_of(CODECS) is None
    key, data = random_key(), random_chunk(seed=7)
    frame = encode(key, data, copy["lz4"])
    assert decode(frame, copy, expect_key=key).equal(data)
    reason = try_decode(encode(key, data, RawCodec()), copy, expect_key=key).reason
    assert reason is not None and "not sealed" in reason
    assert isinstance(copy["raw"], SealedCodec) and copy["lz4"].max_ratio == Lz4Codec.max_ratio  # type: ignore[attr-defined]


# -- configuration -----------------------------------------------------------------


def test_frame_secret_from_config_env_and_file(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={"frame_secret": SECRET}).config
    assert read_frame_secret(cfg) == SECRET
    assert SECRET not in repr(cfg) and SECRET not in str(cfg.model_dump())
    # the env var is taken verbatim: YAML would turn these into numbers or booleans
    for raw in ("0x1000000000000000000", "123456789012345678", "yes-no-on-off-true"):
        cfg = load_config(env={"LMCACHE_CORE_FRAME_SECRET": raw}).config
        assert read_frame_secret(cfg) == raw
    f = tmp_path / "secret"
    f.write_text(SECRET + "\nsecond line ignored\n")
    f.chmod(0o600)
    cfg = load_config(env={}, overrides={"frame_secret_file": str(f)}).config
    assert read_frame_secret(cfg) == SECRET
    assert read_frame_secret(load_config(env={}).config) is None


def test_bad_secrets_are_clear_errors_that_never_quote_the_secret(tmp_path: Path) -> None:
    weak = "tooshort"
    with pytest.raises(ConfigError, match="at least 16 bytes") as err:
        load_config(env={}, overrides={"frame_secret": weak})
    assert weak not in str(err.value)
    with pytest.raises(ConfigError, match="not both"):
        load_config(env={}, overrides={"frame_secret": SECRET, "frame_secret_file": "/x"})
    f = tmp_path / "weak"
    f.write_text(weak)
    f.chmod(0o600)
    for path, msg in ((str(f), "shorter than 16"), (str(tmp_path / "absent"), "cannot open"), (str(tmp_path), "not a regular")):
        cfg = load_config(env={}, overrides={"frame_secret_file": path}).config
        with pytest.raises(ConfigError, match=msg) as err:
            read_frame_secret(cfg)
        assert weak not in str(err.value)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    with pytest.raises(ConfigError, match="larger than 4096"):
        read_frame_secret(load_config(env={}, overrides={"frame_secret_file": str(big)}).config)


def test_a_fifo_as_secret_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cfg = load_config(env={}, overrides={"frame_secret_file": str(fifo)}).config
    result: list[BaseException] = []
    t = threading.Thread(target=lambda: result.append(pytest.raises(ConfigError, read_frame_secret, cfg).value), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "reading a FIFO as the secret file blocked"
    assert result and "not a regular file" in str(result[0])


OPEN_MODES = [
    (0o644, "readable by every user"),
    (0o604, "readable by every user"),
    (0o640, "readable by its group"),
    (0o660, "readable by its group"),
    (0o620, "writable by other users"),
    (0o602, "writable by other users"),
    (0o610, "open to users other than its owner"),
]


@pytest.mark.parametrize(("mode", "said"), OPEN_MODES, ids=[f"{m:04o}" for m, _ in OPEN_MODES])
def test_a_secret_file_others_can_open_is_refused_naming_the_fix(tmp_path: Path, mode: int, said: str) -> None:
    """Hardening round 3: a group-readable file was taken silently and a world-readable
    one with a warning, though anyone who reads it can seal forged KV."""
    f = tmp_path / "secret"
    f.write_text(SECRET)
    f.chmod(mode)
    cfg = load_config(env={}, overrides={"frame_secret_file": str(f)}).config
    with pytest.raises(ConfigError, match=said) as err:
        read_frame_secret(cfg)
    assert f"chmod 600 {f}" in str(err.value) and f"mode {mode:04o}" in str(err.value)
    assert SECRET not in str(err.value)
    f.chmod(0o600)  # the fix the message names
    assert read_frame_secret(cfg) == SECRET


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=["0600", "0400"])
def test_a_secret_file_private_to_its_owner_is_taken(tmp_path: Path, mode: int) -> None:
    """Negative control for the test above: owner-only modes pass."""
    f = tmp_path / "secret"
    f.write_text(SECRET)
    f.chmod(mode)
    assert read_frame_secret(load_config(env={}, overrides={"frame_secret_file": str(f)}).config) == SECRET


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_secret_file_of_another_user_is_refused(tmp_path: Path) -> None:
    """Mode 600 keeps a file from everyone but its owner: owned by another user, that
    user can read it (and rewrite it). The owner must be this user or root."""
    f = tmp_path / "secret"
    f.write_text(SECRET)
    f.chmod(0o600)
    cfg = load_config(env={}, overrides={"frame_secret_file": str(f)}).config
    assert read_frame_secret(cfg) == SECRET  # negative control: root's own file
    os.chown(f, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to uid 4242") as err:
        read_frame_secret(cfg)
    assert f"chown {os.geteuid()} {f}" in str(err.value) and SECRET not in str(err.value)


def test_frame_secret_none_is_the_explicit_no_secret(tmp_path: Path) -> None:
    """``frame_secret: none`` is a choice written in the config (file, env var or an
    override such as kv_connector_extra_config): no secret, and no warning for it. The
    word can never be a real secret (4 bytes, under the 16 a secret needs)."""
    p = tmp_path / "c.yaml"
    p.write_text("frame_secret: none\n")
    sources = [
        load_config(p, env={}),
        load_config(None, env={"LMCACHE_CORE_FRAME_SECRET": "none"}),
        load_config(None, env={}, overrides={"frame_secret": "none"}, overrides_source="kv_connector_extra_config"),
    ]
    for loaded in sources:
        assert loaded.config.frame_secret_declined and read_frame_secret(loaded.config) is None
    # negative controls: nothing said, a real secret, and spellings that are not the word
    assert not load_config(None, env={}).config.frame_secret_declined
    assert not load_config(None, env={}, overrides={"frame_secret": SECRET}).config.frame_secret_declined
    for near in ("None", "NONE", " none", "none ", "nothing"):
        with pytest.raises(ConfigError, match="at least 16 bytes \\(or exactly none"):
            load_config(None, env={}, overrides={"frame_secret": near})
    f = tmp_path / "secret"
    f.write_text(SECRET)
    f.chmod(0o600)
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, env={}, overrides={"frame_secret": "none", "frame_secret_file": str(f)})


# -- MAC comparisons -------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "lmcache_core", ROOT / "connector", ROOT / "examples", *sorted((ROOT / "backends").glob("*/lmcache_backend_*"))]


def _is_digest(node: ast.expr) -> bool:
    """An expression that holds a checksum or MAC: ``x.hexdigest()`` / ``x.digest()``,
    ``meta["checksum"]``, ``meta.get("checksum")``, ``x.mac`` or ``mac``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("hexdigest", "digest"):
            return True
        if node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
            return node.args[0].value in ("checksum", "mac")
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value in ("checksum", "mac")
    return (isinstance(node, ast.Attribute) and node.attr == "mac") or (isinstance(node, ast.Name) and node.id == "mac")


def digest_comparisons(source: str, name: str = "<src>") -> list[str]:
    """``==`` / ``!=`` comparisons of a checksum or MAC in ``source``: each one's
    time tells an attacker how many leading bytes of a forged MAC are right."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            if any(_is_digest(e) for e in [node.left, *node.comparators]):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_mac_or_checksum_is_compared_with_eq_anywhere() -> None:
    """Every MAC and checksum comparison (core, connector, every backend, the example
    backend) goes through hmac.compare_digest (serde.checksum_matches). Before round 3,
    serde, the disk tier and the peer tier's shared-memory path compared with ``!=``."""
    found = []
    for tree in SOURCES:
        for path in sorted(tree.rglob("*.py")):
            found += digest_comparisons(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_the_comparison_scan_finds_what_it_looks_for() -> None:
    """Negative control: the scan flags the spellings round 3 removed, and not their fix."""
    assert len(SOURCES) >= 7 and all(p.is_dir() for p in SOURCES)
    bad = [
        'if hasher.hexdigest() != meta["checksum"]: pass',
        'if payload_checksum(meta, payload) != meta.get("checksum"): pass',
        "ok = reply.mac == expected",
    ]
    for line in bad:
        assert len(digest_comparisons(line)) == 1, line
    good = 'if not checksum_matches(meta, hasher.hexdigest()): pass\nok = hmac.compare_digest(reply.mac, x)\nk != "checksum"'
    assert digest_comparisons(good) == []


def test_frames_are_checked_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    key, data = random_key(), random_chunk(shape=(4, 8), seed=8)
    for codecs in (CODECS, sealed_codecs()):
        calls.clear()
        frame = encode(key, data, codecs["raw"])
        _, meta, payload = parse_header(frame)
        assert decode(frame, codecs, expect_key=key).equal(data)
        assert any(b == meta["checksum"].encode() for _, b in calls), "the checksum was not compared with compare_digest"
        last = meta["checksum"][-1]
        forged = _rewrite_header(frame, checksum=meta["checksum"][:-1] + ("0" if last != "0" else "1"))
        with pytest.raises(FrameError, match="mismatch"):
            decode(forged, codecs, expect_key=key)
    # a planted header's checksum need not be ASCII: no match, never a TypeError
    assert not serde.checksum_matches({"checksum": "\u00e9" * 16}, "0" * 16)
    assert not serde.checksum_matches({}, "0" * 16)


# -- the engine --------------------------------------------------------------------


def shared_frames() -> MemoryTierPlugin:
    """The reference tier as a shared byte store written the way every plugin tier
    writes: serde frames from ``ctx.codec``, read back with ``ctx.codecs``."""
    return MemoryTierPlugin("shared_frames", shared=True)


def _engine(plugin: MemoryTierPlugin, **cfg: Any) -> CacheEngine:
    pm = PluginManager(load_entry_points=False)
    pm.register(plugin, name="shared-frames")
    backends = [{"name": "local_cpu", "max_size": "4MiB"}, {"name": "shared_frames", "frames": True}]
    loaded = load_config(env={}, overrides={"chunk_size": 16, "backends": backends, **cfg})
    return CacheEngine(loaded, namespace=KeyNamespace(model="seal-test"), plugins=pm)


def _plant_and_retrieve(eng: CacheEngine, plugin: MemoryTierPlugin) -> tuple[int, torch.Tensor]:
    """Store two chunks, drop them from the CPU tier, plant a plain frame (valid
    checksum, all 666.0) for the second in the shared tier; retrieve both."""
    tokens = list(range(32))
    chunks = [random_chunk(shape=(2, 16, 8), seed=s) for s in (1, 2)]
    keys = eng.keys(token_hashes(eng, tokens))
    assert store_tokens(eng, tokens, chunks) == 2 and eng.flush(10)
    for k in keys:
        eng.tiers[0].remove(k)
    tier = plugin.created[-1]
    tier.plant(keys[1], encode(keys[1], torch.full_like(chunks[1], 666.0), RawCodec()))
    outs = [torch.zeros_like(c) for c in chunks]
    n = retrieve_tokens(eng, tokens, outs)
    assert torch.equal(outs[0], chunks[0])
    return n, outs[1]


def test_engine_with_a_secret_serves_no_planted_frame(caplog: pytest.LogCaptureFixture) -> None:
    plugin = shared_frames()
    # negative control: without the secret the planted frame is served (the attack works),
    # and the engine said so at start-up
    with caplog.at_level(logging.WARNING, logger="lmcache_core.engine"):
        with _engine(plugin) as eng:
            n, second = _plant_and_retrieve(eng, plugin)
    assert n == 2 and float(second.flatten()[0]) == 666.0
    assert "frame_secret is not set" in caplog.text and "shared_frames" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmcache_core.engine"):
        with _engine(plugin, frame_secret=SECRET) as eng:
            assert eng.seal == FrameSeal(SECRET)
            n, _ = _plant_and_retrieve(eng, plugin)
    assert n == 1, "the planted chunk was served"
    assert plugin.created[-1].stats().misses >= 1
    assert "frame_secret is not set" not in caplog.text and FrameSeal(SECRET).key_id in caplog.text
    assert SECRET not in caplog.text


def test_a_shared_tier_unsealed_warns_unless_the_config_says_frame_secret_none(caplog: pytest.LogCaptureFixture) -> None:
    """A shared tier without a secret is a choice written in the config: without
    ``frame_secret: none`` the engine starts with a warning that names that key; with
    it, the start is warning-free (an info line says it was chosen, and where) and the
    tier is unsealed, as chosen."""
    plugin = shared_frames()
    with caplog.at_level(logging.INFO, logger="lmcache_core.engine"):
        with _engine(plugin):
            pass
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "shared_frames" in warned[0] and "frame_secret: none" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmcache_core.engine"):
        with _engine(plugin, frame_secret="none") as eng:
            assert eng.seal is None
            n, second = _plant_and_retrieve(eng, plugin)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "shared_frames are shared and their frames are not sealed: frame_secret: none (from programmatic override)" in (
        caplog.text
    )
    assert n == 2 and float(second.flatten()[0]) == 666.0  # unsealed, as the config says
    # negative control: no shared tier, nothing to warn about, with or without the word
    caplog.clear()
    pm = PluginManager(load_entry_points=False)
    with caplog.at_level(logging.INFO, logger="lmcache_core.engine"):
        for extra in ({}, {"frame_secret": "none"}):
            loaded = load_config(env={}, overrides={"chunk_size": 16, **extra})
            with CacheEngine(loaded, namespace=KeyNamespace(model="seal-test"), plugins=pm):
                pass
    assert "shared" not in caplog.text
