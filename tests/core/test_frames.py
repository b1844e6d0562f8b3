"""lmcache_core.frames: the backend authors' frame API gives exactly serde's bytes and
verdicts, and every backend in this repository needs at most six names of it."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from lmcache_core import serde
from lmcache_core.frames import FrameError, FrameHeader, FrameReader, FrameWriter, Verdict
from lmcache_core.keys import ChunkKey
from lmcache_core.serde import RAW, FrameSeal, Lz4Codec, SealedCodec, SealedCodecs

ROOT = Path(__file__).resolve().parents[2]
MAX_NAMES = 6
FRAME_MODULES = ("lmcache_core.serde", "lmcache_core.frames")


def key(n: int = 1) -> ChunkKey:
    return ChunkKey(b"n" * 16, n.to_bytes(16, "little"))


def tensor() -> torch.Tensor:
    return torch.arange(2 * 3 * 64, dtype=torch.float32).reshape(2, 3, 64)


CODECS = {"raw": RAW, "lz4": Lz4Codec()}
SEAL = FrameSeal("a test secret of enough bytes")


@pytest.mark.parametrize("codec", [RAW, Lz4Codec()], ids=["raw", "lz4"])
@pytest.mark.parametrize("sealed", [False, True])
def test_writer_bytes_are_serde_bytes(codec: serde.Codec, sealed: bool) -> None:
    c: serde.Codec = SealedCodec(codec, SEAL) if sealed else codec
    t = tensor()
    w = FrameWriter(key(), t, c)
    frame = serde.encode(key(), t, c)
    assert w.to_bytes() == frame == FrameWriter.encode(key(), t, c)
    header, payload = w.parts()
    assert header + bytes(payload) == frame
    assert len(header) == w.header_len and w.size == len(frame)
    assert w.zero_copy is (codec.name == "raw")
    h = w.hasher()
    for i in range(0, payload.nbytes, 100):  # hashed as a streaming writer would
        h.update(payload[i : i + 100])
    assert w.header_with(h.hexdigest()) == header
    assert (w.seal is not None) is sealed
    if codec.name == "raw":
        assert FrameWriter.header_size(key(), t, seal=w.seal) == w.header_len


def test_reader_decodes_into_out_and_reports_verdicts() -> None:
    t = tensor()
    frame = FrameWriter.encode(key(), t, RAW)
    out = torch.empty_like(t)
    got = FrameReader(CODECS).decode(frame, key=key(), out=out)
    assert got.verdict is Verdict.OK and got.tensor is out and torch.equal(out, t)
    assert FrameReader(CODECS).decode(None, key=key(), out=out).verdict is Verdict.MISSING
    assert FrameReader(CODECS).decode(frame, key=key(2), out=out).verdict is Verdict.FOREIGN
    assert FrameReader(CODECS).decode(frame, key=key(), out=torch.empty(3)).verdict is Verdict.WRONG_SHAPE
    bad = bytearray(frame)
    bad[-1] ^= 1
    assert FrameReader(CODECS).decode(bytes(bad), key=key(), out=out).verdict is Verdict.CORRUPT
    # the verdict from the header alone, as a bounded prefix read gives it
    assert FrameReader(CODECS).verdict(frame[:400], len(frame), key=key(), out=out) is Verdict.OK
    assert FrameReader(CODECS).verdict(frame[:400], len(frame), key=key(), out=torch.empty(3)) is Verdict.WRONG_SHAPE
    assert FrameReader(CODECS).verdict(frame[:400], len(frame) + 1, key=key(), out=out) is Verdict.CORRUPT


def test_seals_are_handled_inside() -> None:
    t = tensor()
    sealed = FrameWriter.encode(key(), t, SealedCodec(RAW, SEAL))
    out = torch.empty_like(t)
    assert FrameReader(SealedCodecs(CODECS, SEAL)).decode(sealed, key=key(), out=out).verdict is Verdict.OK
    assert FrameReader(CODECS).decode(sealed, key=key(), out=out).verdict is Verdict.FOREIGN
    plain = FrameWriter.encode(key(), t, RAW)
    assert FrameReader(CODECS, seal=SEAL).decode(plain, key=key(), out=out).verdict is Verdict.FOREIGN
    header = FrameHeader.parse(sealed)
    assert header.sealed and FrameReader(seal=SEAL).verify(header, header.payload(sealed)) is None
    with pytest.raises(FrameError) as err:
        FrameReader(CODECS).check(header, key=key(), out=out)
    assert err.value.verdict is Verdict.FOREIGN and not err.value.keep_if_intact


def test_header_first_streaming_read_into_out() -> None:
    """What a tier that reads header and payload separately does (positioned I/O)."""
    t = tensor()
    frame = FrameWriter.encode(key(), t, RAW)
    span = FrameHeader.span(frame[:8])
    header = FrameHeader.parse(frame[:span], len(frame))
    assert (header.key, header.dtype, header.shape, header.offset, header.size) == (
        key().to_str(),
        "float32",
        (2, 3, 64),
        span,
        len(frame),
    )
    reader = FrameReader(CODECS)
    assert reader.check(header, key=key(), out=torch.empty_like(t)).name == "raw"
    out = torch.empty_like(t)
    dst = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
    v = reader.verifier(header)
    for i in range(0, header.payload_len, 256):  # bytes arrive straight into ``out``
        dst[i : i + 256] = frame[span + i : span + i + 256]
        v.update(dst[i : i + 256])
    v.check()
    assert v.matches() and torch.equal(out, t)
    v = reader.verifier(header)
    v.update(b"\0" * header.payload_len)
    with pytest.raises(FrameError, match="checksum mismatch"):
        v.check()
    # decode first, hash what was decoded (a tensor counts as its bytes)
    out2 = torch.empty_like(t)
    reader.decode_unverified(header, header.payload(frame), out2)
    v = reader.verifier(header)
    v.update(out2)
    assert v.matches() and torch.equal(out2, t)


def test_check_marks_frames_worth_keeping() -> None:
    t = tensor()
    header = FrameHeader.parse(FrameWriter.encode(key(), t, Lz4Codec()))
    with pytest.raises(FrameError) as err:
        FrameReader({"raw": RAW}).check(header, key=key(), out=torch.empty_like(t))
    assert err.value.verdict is Verdict.FOREIGN and err.value.keep_if_intact  # codec not installed here
    with pytest.raises(FrameError) as err:
        FrameReader(CODECS).check(header, key=key(), out=torch.empty(3))
    assert err.value.verdict is Verdict.WRONG_SHAPE and err.value.keep_if_intact
    # an index record: fields only, no metadata; equal to the parsed header
    record = FrameHeader(header.key, header.codec, header.dtype, header.shape, header.raw_len, header.payload_len)
    assert record == header and record.meta is None
    assert FrameReader(CODECS).check(record, key=key(), out=torch.empty_like(t)).name == "lz4"


def test_header_parse_refuses_what_serde_refuses() -> None:
    frame = FrameWriter.encode(key(), tensor(), RAW)
    for bad in (frame[:4], frame[:-1], frame + b"x"):
        with pytest.raises(FrameError):
            FrameHeader.parse(bad)
    header, (info, meta, payload) = FrameHeader.parse(frame), serde.parse_header(frame)
    fields = ("key", "codec", "dtype", "shape", "raw_len", "payload_len")
    assert [getattr(header, f) for f in fields] == [getattr(info, f) for f in fields]
    assert header.meta == meta and bytes(header.payload(frame)) == bytes(payload)


# -- every backend needs at most six names of the frame API ---------------------------------


def frame_names(package: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """The names each module under ``package`` imports from serde or frames. A
    module import (``import lmcache_core.serde``, ``from lmcache_core import
    frames``) reaches every name: it shows as ``<module>.*`` and fails the rule."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in FRAME_MODULES:
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module == "lmcache_core":
                names |= {f"{a.name}.*" for a in node.names if a.name in ("serde", "frames")}
            elif isinstance(node, ast.Import):
                names |= {f"{a.name}.*" for a in node.names if a.name in FRAME_MODULES}
        if names:
            found[str(path.relative_to(root))] = names
    return found


def packages() -> list[Path]:
    roots = [ROOT / "backends" / d for d in sorted(os.listdir(ROOT / "backends"))]
    roots.append(ROOT / "examples" / "lmcache-backend-example")
    out = []
    for root in roots:
        out += [p.parent for p in root.glob("**/lmcache_backend_*/__init__.py") if not {"tests", "build"} & set(p.parts)]
    return out


def test_every_backend_imports_at_most_six_frame_names() -> None:
    pkgs = packages()
    assert {p.name for p in pkgs} >= {f"lmcache_backend_{b}" for b in ("disk", "s3", "peer", "redis", "mooncake", "example")}
    over = {}
    for pkg in pkgs:
        names: set[str] = set().union(*frame_names(pkg).values())
        if len(names) > MAX_NAMES or any(n.endswith(".*") for n in names):
            over[pkg.name] = sorted(names)
    assert over == {}


def test_import_counts_per_backend() -> None:
    """The counts the docs quote (docs/plugins.md), one package at a time."""
    counts = {p.name: len(set().union(*frame_names(p).values())) for p in packages()}
    assert all(0 < n <= MAX_NAMES for n in counts.values()), counts


def test_the_count_finds_too_many_names(tmp_path: Path) -> None:
    """Negative control: a package importing seven names (over two modules, one of
    them through serde) and one importing the module itself are both counted."""
    pkg = tmp_path / "lmcache_backend_bad"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from lmcache_core.frames import Codec, FrameError, FrameHeader, FrameReader\n")
    (pkg / "b.py").write_text("from lmcache_core.serde import FrameWriter, Verdict, encode\nimport lmcache_core.serde\n")
    names = set().union(*frame_names(pkg, tmp_path).values())
    assert len({n for n in names if not n.endswith(".*")}) == 7
    assert "lmcache_core.serde.*" in names
