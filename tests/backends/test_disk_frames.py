"""The tier writes frames in two parts (header, payload) and reads raw payloads
straight into the caller's tensor. These tests pin that the bytes on disk are
exactly ``lmcache_core.serde.encode``'s and that every path still decodes with
``serde.decode``, so the tier cannot drift from the core's frame format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmcache_backend_disk import create_disk_backend
from lmcache_backend_disk.frames import check_frame_file, read_frame_header
from lmcache_core.serde import FrameError, decode, encode, encode_parts
from lmcache_core.testing import make_context, random_chunk, random_key

CASES = [
    ((4, 2, 64, 32), torch.float16),
    ((3, 1000), torch.bfloat16),
    ((5 << 18,), torch.uint8),  # 1.25 MiB
    ((3 << 20,), torch.float32),  # 12 MiB: written and read in overlapped segments
    ((0,), torch.float32),
]


@pytest.mark.parametrize("codec", ["raw", "lz4"])
@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("shape,dtype", CASES)
def test_file_bytes_equal_serde_encode(tmp_path: Path, codec: str, o_direct: bool, shape, dtype) -> None:
    ctx = make_context(codec=codec)
    b = create_disk_backend({"path": str(tmp_path / "t"), "o_direct": o_direct}, ctx)
    data = random_chunk(shape, dtype=dtype) if dtype != torch.uint8 else torch.randint(0, 256, shape, dtype=dtype)
    key = random_key()
    assert b.put(key, data)
    on_disk = b.directory.chunk_path(key).read_bytes()
    assert on_disk == encode(key, data, ctx.codec)
    assert torch.equal(decode(on_disk, ctx.codecs, expect_key=key).view(torch.uint8), data.view(torch.uint8))
    out = torch.full_like(data, 7) if data.numel() else torch.empty_like(data)
    assert b.get(key, out) and torch.equal(out.view(torch.uint8), data.view(torch.uint8))
    b.close()


def test_header_read_from_a_file(tmp_path: Path) -> None:
    import os

    key, data = random_key(), random_chunk((8, 8))
    header, payload = encode_parts(key, data, make_context().codec)
    frame = encode(key, data, make_context().codec)
    assert frame == header + bytes(payload)
    p = tmp_path / "f"
    p.write_bytes(frame)
    fd = os.open(p, os.O_RDONLY)
    try:
        info, meta, offset = read_frame_header(fd, len(frame))
        assert offset == len(header) and info.key == key.to_str() and meta["format"] == "lmcache-core/2"
        with pytest.raises(FrameError):
            read_frame_header(fd, len(frame) - 1)  # truncated file
    finally:
        os.close(fd)
    check_frame_file(str(p), len(frame), key.to_str())
    with pytest.raises(FrameError, match="holds key"):
        check_frame_file(str(p), len(frame), random_key().to_str())
    p.write_bytes(frame[:4])
    with pytest.raises(FrameError):
        check_frame_file(str(p), 4, key.to_str())


def test_long_header_needs_a_second_read(tmp_path: Path) -> None:
    """A header longer than the first read (here: a 1500-dimension shape) is read in full."""
    import os

    from lmcache_backend_disk.frames import PREFIX_READ

    key, data = random_key(), torch.zeros((1,) * 1500, dtype=torch.float16)
    frame = encode(key, data, make_context().codec)
    assert int.from_bytes(frame[:8], "little") > PREFIX_READ
    p = tmp_path / "f"
    p.write_bytes(frame)
    fd = os.open(p, os.O_RDONLY)
    try:
        info, _, offset = read_frame_header(fd, len(frame))
    finally:
        os.close(fd)
    assert info.key == key.to_str() and offset == len(frame) - data.nbytes


def test_format_1_file_is_a_miss_and_removed(tmp_path: Path) -> None:
    b = create_disk_backend({"path": str(tmp_path / "t")}, make_context())
    key, data = random_key(), random_chunk((4, 16))
    assert b.put(key, data)
    p = b.directory.chunk_path(key)
    p.write_bytes(p.read_bytes().replace(b'"format":"lmcache-core/2"', b'"format":"lmcache-core/1"'))
    assert b.get(key, torch.empty_like(data)) is False and not p.exists()
    b.close()


def test_non_contiguous_out_uses_the_whole_frame_path(tmp_path: Path) -> None:
    b = create_disk_backend({"path": str(tmp_path / "t")}, make_context())
    key, data = random_key(), random_chunk((64, 64))
    assert b.put(key, data)
    out = torch.empty(64, 64, dtype=torch.float16).t()  # right shape, not contiguous
    assert not out.is_contiguous()
    assert b.get(key, out) and torch.equal(out, data)
    b.close()


def test_truncated_large_payload_is_a_miss(tmp_path: Path) -> None:
    """A file cut inside a multi-segment payload (the overlapped read path)."""
    b = create_disk_backend({"path": str(tmp_path / "t"), "verify_on_start": False}, make_context())
    key, data = random_key(), torch.randint(0, 256, (6 << 20,), dtype=torch.uint8)
    assert b.put(key, data)
    p = b.directory.chunk_path(key)
    frame = p.read_bytes()
    bad = bytearray(frame)
    bad[len(frame) // 2] ^= 1
    p.write_bytes(bytes(bad))
    assert b.get(key, torch.empty_like(data)) is False and not p.exists()
    assert b.put(key, data)
    with open(p, "r+b") as f:
        f.truncate(len(frame) - 3 * (1 << 20))
    assert b.get(key, torch.empty_like(data)) is False and not p.exists()
    assert b.stats().extra["corrupt_removed"] == 2
    b.close()


def test_large_chunks_from_many_threads_with_one_io_thread(tmp_path: Path) -> None:
    """More concurrent callers than I/O threads: overlapped transfers queue, never
    deadlock, and every caller gets its own bytes."""
    import threading

    b = create_disk_backend({"path": str(tmp_path / "t"), "io_threads": 1, "fsync": False}, make_context())
    items = [(random_key(), torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)) for _ in range(6)]
    errors: list[BaseException] = []

    def work(k, d) -> None:
        try:
            for _ in range(3):
                assert b.put(k, d)
                out = torch.empty_like(d)
                assert b.get(k, out) and torch.equal(out, d)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=item) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    b.close()


def _open(path: Path, codecs: dict | None = None):
    from lmcache_backend_disk import DiskBackend, DiskConfig
    from lmcache_core.serde import Lz4Codec, RawCodec

    codecs = codecs or {"raw": RawCodec(), "lz4": Lz4Codec()}
    b = DiskBackend(DiskConfig(path=str(path)), codec=next(iter(codecs.values())), codecs=codecs)
    # the tests rewrite chunk files in place: a start-up scan still running could read
    # one half-written and remove it as truncated before the read under test
    assert b.wait_for_scan(60)
    return b


def test_header_byte_faking_a_foreign_codec_is_removed(tmp_path: Path) -> None:
    b = _open(tmp_path / "t")
    key, data = random_key(), random_chunk((2, 64))
    assert b.put(key, data)
    p = b.directory.chunk_path(key)
    raw = p.read_bytes()
    i = raw.index(b'"codec":"raw"') + len(b'"codec":"')
    p.write_bytes(raw[:i] + b"s" + raw[i + 1 :])  # "raw" -> "saw"
    assert b.get(key, torch.empty_like(data)) is False
    assert not p.exists() and b.stats().extra["corrupt_removed"] == 1


def test_header_byte_faking_another_shape_is_removed(tmp_path: Path) -> None:
    b = _open(tmp_path / "t")
    key, data = random_key(), random_chunk((2, 64))
    assert b.put(key, data)
    p = b.directory.chunk_path(key)
    raw = p.read_bytes()
    p.write_bytes(raw.replace(b'"shape":"[2, 64]"', b'"shape":"[4, 32]"', 1))
    assert b.get(key, torch.empty(4, 32, dtype=torch.float16)) is False
    assert not p.exists() and b.stats().extra["corrupt_removed"] == 1


def test_intact_frame_with_a_codec_not_installed_here_is_kept(tmp_path: Path) -> None:
    from lmcache_core.serde import Lz4Codec, RawCodec

    key, data = random_key(), torch.zeros(4096, dtype=torch.float32)
    writer = _open(tmp_path / "t", {"lz4": Lz4Codec(), "raw": RawCodec()})
    assert writer.put(key, data)
    reader = _open(tmp_path / "t", {"raw": RawCodec()})
    assert reader.get(key, torch.empty_like(data)) is False
    assert reader.directory.chunk_path(key).exists() and reader.stats().extra["corrupt_removed"] == 0
    out = torch.full_like(data, 1.0)
    assert writer.get(key, out) and torch.equal(out, data)


@pytest.mark.parametrize("mode", ["cached", "no_nowait", "uncached_after_3_mib", "uncached"])
def test_read_and_hash_paths_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Payload segments already in the page cache are read and hashed inline, the
    rest through the I/O pool; every split gives the same bytes and checksum, and a
    flipped byte is caught on either side of the split."""
    import os

    from lmcache_backend_disk import fileio

    if mode == "no_nowait":
        monkeypatch.setattr(fileio, "_RWF_NOWAIT", 0)
    elif mode.startswith("uncached"):
        limit = 3 << 20 if mode == "uncached_after_3_mib" else 0
        real = os.preadv

        def preadv(fd, bufs, offset, flags=0):  # type: ignore[no-untyped-def]
            if flags and offset >= limit:
                raise BlockingIOError(11, "would block")
            return real(fd, bufs, offset, flags)

        monkeypatch.setattr(fileio.os, "preadv", preadv)
    b = create_disk_backend({"path": str(tmp_path / "t"), "verify_on_start": False}, make_context())
    key, data = random_key(), torch.randint(0, 256, (7 << 20,), dtype=torch.uint8)
    assert b.put(key, data)
    out = torch.empty_like(data)
    assert b.get(key, out) and torch.equal(out, data)
    p = b.directory.chunk_path(key)
    for pos in (len(p.read_bytes()) - 100, len(p.read_bytes()) - (6 << 20)):  # after and before the split
        bad = bytearray(p.read_bytes())
        bad[pos] ^= 0x10
        p.write_bytes(bytes(bad))
        assert b.get(key, torch.empty_like(data)) is False and not p.exists()
        assert b.put(key, data)
    b.close()
