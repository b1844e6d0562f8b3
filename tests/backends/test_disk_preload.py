"""The config's ``preload``: a starting engine reads its namespace's chunks from the
disk tier (real files, written by an earlier engine) into its CPU tier in the
background, newest first, so a first request loads from memory (no disk read).

Bounded: the byte budget, the CPU tier's free room (a preload never evicts), one
whole chunk's size, the engine's dtype and namespace; a corrupt file is skipped (and
removed, as any read removes it); ``preload: 0`` (the default) reads nothing, the
control that shows a first request otherwise reads the disk tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmcache_core.config import load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import KeyNamespace
from lmcache_core.preload import PreloadResult

CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 8)  # [layers, k/v, tokens, kv_heads, head_size]
PARTIAL = (2, 2, 5, 2, 8)  # a prompt's trailing partial chunk (5 tokens)
DTYPE = torch.bfloat16
FULL_BYTES = 2 * 2 * CHUNK * 2 * 8 * 2
NS = KeyNamespace(model="preload-test")


def engine(
    disk: Path, preload: int | str = 0, cpu: str = "1MiB", ns: KeyNamespace = NS, eviction: str | None = None
) -> CacheEngine:
    tier0: dict[str, object] = {"name": "local_cpu", "max_size": cpu}
    if eviction is not None:
        tier0["eviction"] = eviction
    cfg = load_config(
        env={},
        overrides={"chunk_size": CHUNK, "preload": preload, "backends": [tier0, {"name": "disk", "path": str(disk)}]},
    )
    return CacheEngine(cfg, namespace=ns)


def chunk(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def write(disk: Path, hashes: list[bytes], chunks: list[torch.Tensor], ns: KeyNamespace = NS) -> None:
    """Store each chunk through an engine (disk written behind), in order."""
    with engine(disk, ns=ns) as e:
        for h, c in zip(hashes, chunks):
            assert e.store_hashes([h], [c]) == 1
            assert e.flush(30)


def run(e: CacheEngine) -> PreloadResult:
    result = e.preload(DTYPE, FULL_BYTES)
    assert result is not None and e.preloader is not None
    assert e.preloader.done.wait(30), "preload did not end"
    return result


def disk_hits(e: CacheEngine) -> int:
    return e.tiers[1].stats().hits


HASHES = [bytes([i + 1]) * 16 for i in range(6)]


def test_preload_fills_the_cpu_tier_and_first_reads_come_from_memory(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    chunks = [chunk(i) for i in range(5)] + [chunk(5, PARTIAL)]
    write(disk, HASHES, chunks)
    with engine(disk, preload="1MiB") as e:
        r = run(e)
        assert (r.chunks, r.bytes, r.skipped, r.stopped) == (
            6,
            5 * FULL_BYTES + FULL_BYTES * 5 // CHUNK,
            0,
            "every listed chunk read",
        )
        reads_after_preload = disk_hits(e)
        assert reads_after_preload == 6
        assert e.tiers[0].stats().chunks == 6
        for h, want in zip(HASHES, chunks):
            buf = e.retrieve_buffer(h, want.shape, DTYPE)
            assert buf is not None
            assert torch.equal(buf.tensor.view(torch.uint8), want.view(torch.uint8))
            buf.release()
        assert disk_hits(e) == reads_after_preload, "a first read went to the disk tier"
        assert e.stats()["preload"] == r.as_dict()


def test_without_preload_a_first_read_goes_to_disk(tmp_path: Path) -> None:
    """The control: with the default ``preload: 0`` nothing is read at start and the
    first read of a chunk is a disk read."""
    disk = tmp_path / "disk"
    write(disk, HASHES[:2], [chunk(0), chunk(1)])
    with engine(disk) as e:
        assert e.preload(DTYPE, FULL_BYTES) is None
        assert e.tiers[1].wait_for_scan(30)
        assert e.tiers[0].stats().chunks == 0
        buf = e.retrieve_buffer(HASHES[0], SHAPE, DTYPE)
        assert buf is not None
        buf.release()
        assert disk_hits(e) == 1


def test_budget_takes_the_newest_chunks_first(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    write(disk, HASHES[:5], [chunk(i) for i in range(5)])
    with engine(disk, preload=2 * FULL_BYTES + 1) as e:
        r = run(e)
        assert (r.chunks, r.stopped) == (2, "budget reached")
        cpu = e.tiers[0]
        held = [cpu.contains([k]) == 1 for k in e.keys(HASHES[:5])]
        assert held == [False, False, False, True, True]


def test_the_newest_chunks_end_most_recently_used(tmp_path: Path) -> None:
    """Read oldest first, the newest chunk is the CPU tier's most recent: the first
    eviction after the preload takes the oldest (read newest first, it would take the
    newest, the one most likely wanted)."""
    disk = tmp_path / "disk"
    write(disk, HASHES[:5], [chunk(i) for i in range(5)])
    with engine(disk, preload="1MiB", cpu=str(5 * FULL_BYTES), eviction="lru") as e:
        assert run(e).chunks == 5
        assert e.store_hashes([bytes([99]) * 16], [chunk(99)]) == 1  # one eviction
        cpu = e.tiers[0]
        assert [cpu.contains([k]) == 1 for k in e.keys(HASHES[:5])] == [False, True, True, True, True]


def test_a_full_cpu_tier_stops_the_preload_and_nothing_is_evicted(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    write(disk, HASHES[:5], [chunk(i) for i in range(5)])
    with engine(disk, preload="1MiB", cpu=str(3 * FULL_BYTES)) as e:
        own = bytes([99]) * 16
        assert e.store_hashes([own], [chunk(99)]) == 1  # serving began before the preload
        r = run(e)
        assert (r.chunks, r.stopped) == (2, "memory tier full")
        cpu = e.tiers[0]
        assert cpu.contains(e.keys([own])) == 1
        assert cpu.stats().evictions == 0


def test_the_room_a_preload_checks_is_what_the_pool_charges(tmp_path: Path) -> None:
    """A partial chunk of 640 bytes takes 768 in the pool (256-byte aligned): with
    1,468 bytes free, one fits and a second would evict. Checking 640 bytes against
    the room read two and evicted the chunk stored before the preload."""
    disk = tmp_path / "disk"
    write(disk, HASHES[:3], [chunk(i, PARTIAL) for i in range(3)])
    partial_bytes = FULL_BYTES * 5 // CHUNK
    assert (partial_bytes, partial_bytes % 256) == (640, 128)  # the premise: not a multiple of the alignment
    with engine(disk, preload="1MiB", cpu=str(FULL_BYTES + 768 + 700), eviction="lru") as e:
        own = bytes([99]) * 16
        assert e.store_hashes([own], [chunk(99)]) == 1
        r = run(e)
        cpu = e.tiers[0]
        assert cpu.stats().evictions == 0 and cpu.contains(e.keys([own])) == 1
        assert (r.chunks, r.stopped) == (1, "memory tier full")


def test_other_namespaces_dtypes_and_oversized_chunks_are_not_loaded(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    other = KeyNamespace(model="another-model")
    write(disk, HASHES[:2], [chunk(0), chunk(1)], ns=other)
    write(disk, HASHES[2:4], [chunk(2).float(), chunk(3, (2, 2, 2 * CHUNK, 2, 8))])  # float32; twice a chunk
    write(disk, HASHES[4:5], [chunk(4)])
    with engine(disk, preload="1MiB") as e:
        r = run(e)
        assert (r.chunks, r.skipped) == (1, 2)  # the other namespace is never listed
        assert e.tiers[0].contains(e.keys(HASHES[4:5])) == 1
        assert e.tiers[0].stats().chunks == 1


def test_a_corrupt_file_is_skipped_and_the_rest_loaded(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    write(disk, HASHES[:3], [chunk(i) for i in range(3)])
    with engine(disk) as probe:
        victim = str(probe.keys(HASHES[1:2])[0])
    (path,) = [p for p in disk.rglob(victim)]
    size = path.stat().st_size
    with open(path, "r+b") as f:  # flip a payload byte: the header still parses
        f.seek(size - 7)
        b = f.read(1)
        f.seek(size - 7)
        f.write(bytes([b[0] ^ 0xFF]))
    with engine(disk, preload="1MiB") as e:
        r = run(e)
        assert (r.chunks, r.skipped) == (2, 1)
        assert e.tiers[0].contains(e.keys(HASHES[1:2])) == 0
    assert not path.exists(), "the corrupt file was not removed by the read"


@pytest.mark.parametrize("budget", [0, -1])
def test_preload_off_or_negative_is_refused_or_off(tmp_path: Path, budget: int) -> None:
    if budget < 0:
        with pytest.raises(Exception, match="preload"):
            engine(tmp_path / "disk", preload=budget)
        return
    with engine(tmp_path / "disk", preload=budget) as e:
        assert e.preload(DTYPE, FULL_BYTES) is None and e.preloader is None


def test_close_stops_a_running_preload(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    write(disk, HASHES[:5], [chunk(i) for i in range(5)])
    e = engine(disk, preload="1MiB")
    e.preload(DTYPE, FULL_BYTES)
    e.close()
    assert e.preloader is not None and e.preloader.done.wait(10)
    assert e.preloader.result.stopped in ("closed", "every listed chunk read")
