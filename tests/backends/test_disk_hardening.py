"""The disk tier against damaged files, symbolic links and several writing processes,
with real files and real processes.

1. A chunk file whose header holds malformed numbers (``Infinity`` offsets, a
   2**70 length) never fails a start (``verify_on_start``) and is a removed miss.
2. No symbolic link inside the cache directory is followed: a shard replaced by a
   link to another directory is never entered (start-up deletes nothing there,
   puts never land there), a link under a chunk name is neither read nor deleted,
   and files the tier did not name are never deleted.
3. ``max_size`` holds for the directory: 4 processes writing 512 KiB chunks at once
   into one directory, each with ``max_size: 8MiB``, never make it exceed 8 MiB (sampled
   every 50 ms under the tier's own lock, so each sample is a consistent
   snapshot); a negative control with eviction disabled in the child shows the
   same probe seeing the overshoot.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_backend_disk.directory import FANOUT, USAGE
from lmcache_core.serde import encode
from lmcache_core.testing import make_context, random_chunk, random_key

SHAPE = (16, 64)


def open_disk(path: Path, **opts: Any) -> DiskBackend:
    b = create_disk_backend({"path": str(path), "max_size": "64MiB", **opts}, make_context())
    assert b.wait_for_scan(60)  # start-up indexes in the background: check what it leaves
    return b


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _malformed(frame: bytes, offsets: str) -> bytes:
    (hlen,) = struct.unpack_from("<Q", frame)
    header = json.loads(frame[8 : 8 + hlen])
    text = json.dumps(header).replace(json.dumps(header["payload"]["data_offsets"]), offsets).encode()
    return struct.pack("<Q", len(text)) + text + frame[8 + hlen :]


# -- malformed numbers in a chunk file's header --------------------------------------------
@pytest.mark.parametrize("offsets", ["[0, Infinity]", f"[0, {2**70}]", "[NaN, 1]"])
def test_malformed_header_file_never_fails_start_and_is_removed(tmp_path: Path, offsets: str) -> None:
    b = open_disk(tmp_path / "t")
    good_k, good = random_key(), random_chunk(SHAPE, seed=1)
    bad_k, bad = random_key(), random_chunk(SHAPE, seed=2)
    assert b.put(good_k, good) and b.put(bad_k, bad)
    bad_file = b.directory.chunk_path(bad_k)
    b.close()
    bad_file.write_bytes(_malformed(encode(bad_k, bad, make_context().codec), offsets))
    b2 = open_disk(tmp_path / "t")  # verify_on_start: the start must not fail
    assert b2.stats().extra["startup_bad_removed"] == 1 and not bad_file.exists()
    out = torch.empty_like(good)
    assert b2.get(good_k, out) and torch.equal(out, good)
    b2.close()
    # Without the start-up check the first get finds it: a miss, and removed.
    bad_file.write_bytes(_malformed(encode(bad_k, bad, make_context().codec), offsets))
    b3 = open_disk(tmp_path / "t", verify_on_start=False)
    assert b3.get(bad_k, torch.empty_like(bad)) is False
    assert not bad_file.exists() and b3.stats().extra["corrupt_removed"] == 1
    b3.close()


# -- symbolic links and files the tier did not name -----------------------------------------
def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: (os.readlink(p).encode() if p.is_symlink() else p.read_bytes()) for p in sorted(d.iterdir())}


def test_symlinked_shard_is_never_entered(tmp_path: Path) -> None:
    root = tmp_path / "t"
    b = open_disk(root)
    key, data = random_key(), random_chunk(SHAPE, seed=3)
    assert b.put(key, data)  # negative control: with a real shard the key is stored
    shard = b.directory.shard(key)
    b.close()
    # Someone replaces the shard with a link to a directory outside the cache that
    # holds files looking exactly like the tier's: a stale temp of a dead process, a
    # chunk-named garbage file, a foreign file.
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / f".tmp-{_dead_pid()}-0123456789abcdef").write_bytes(b"keep me 1")
    (outside / b.directory.chunk_path(random_key()).name).write_bytes(b"keep me 2")
    (outside / "notes.txt").write_bytes(b"keep me 3")
    shutil.rmtree(shard)
    shard.symlink_to(outside, target_is_directory=True)
    before = _snapshot(outside)

    b2 = open_disk(root)  # start-up scan with verify_on_start
    assert _snapshot(outside) == before  # nothing outside deleted
    assert b2.stats().extra["startup_shards_refused"] == 1
    assert b2.contains([key]) == 0 and b2.get(key, torch.empty_like(data)) is False
    assert b2.put(key, data) is False  # never lands outside
    other = random_key()
    while other.chunk_hash[:1] != key.chunk_hash[:1]:
        other = random_key()
    assert b2.put(other, data) is False and b2.remove(key) is False
    assert _snapshot(outside) == before
    assert b2.stats().extra["links_refused"] >= 3
    # Other shards work as usual.
    k2 = random_key()
    while k2.chunk_hash[:1] == key.chunk_hash[:1]:
        k2 = random_key()
    assert b2.put(k2, data) and b2.get(k2, torch.empty_like(data))
    b2.close()
    assert shard.is_symlink() and _snapshot(outside) == before


def test_links_under_chunk_and_temp_names_are_neither_followed_nor_deleted(tmp_path: Path) -> None:
    root = tmp_path / "t"
    b = open_disk(root, max_size=1 << 20)
    key, data = random_key(), random_chunk(SHAPE, seed=4)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    target = outside / "frame"
    target.write_bytes(encode(key, data, make_context().codec))  # a valid frame for key
    link = b.directory.chunk_path(key)
    link.symlink_to(target)
    temp_link = b.directory.shard(key) / f".tmp-{_dead_pid()}-00000000000000aa-10"
    temp_link.symlink_to(target)
    assert b.contains([key]) == 0
    assert b.get(key, torch.empty_like(data)) is False  # not followed
    assert b.put(key, data) is False  # not written through or over
    b.close()
    b2 = open_disk(root, max_size=1 << 20)  # start-up scan: the links are not ours
    assert b2.stats().extra["startup_foreign_kept"] >= 2
    for i in range(60):  # ~1.9 MiB of puts through a 1 MiB budget: eviction runs
        assert b2.put(random_key(), random_chunk((128, 128), seed=i)) or True
    b2.close()
    assert link.is_symlink() and temp_link.is_symlink()
    assert target.read_bytes() == encode(key, data, make_context().codec)


# -- one directory budget for every process ------------------------------------------------
WRITER = r"""
import json, os, sys, time
from pathlib import Path
from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_core.testing import make_context, random_chunk, random_key

root, n, go, mode = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
if mode == "no-budget":  # negative control: eviction disabled
    DiskBackend._evict_locked = lambda self, budget, size: True
b = create_disk_backend({"path": root, "max_size": "8MiB", "fsync": False}, make_context())
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.005)
ok, recent_hits, wrong = 0, 0, 0
keys = []
for i in range(n):
    k, d = random_key(), random_chunk((128, 2048), seed=os.getpid() * 1000 + i)  # 512 KiB
    ok += b.put(k, d)
    keys.append((k, d))
for k, d in keys[-4:]:  # may have been evicted by the others meanwhile: a hit must be right
    out = d.clone().zero_()
    if b.get(k, out):
        recent_hits += 1
        wrong += not bool((out == d).all())
s = b.stats()
b.close()
print(json.dumps({"ok": ok, "recent_hits": recent_hits, "wrong": wrong, "evictions": s.evictions, "skipped": s.skipped}))
"""

BUDGET = 8 << 20


def _dir_bytes(root: Path) -> int:
    total = 0
    for shard in FANOUT:
        try:
            with os.scandir(root / shard) as it:
                for e in it:
                    try:
                        total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        pass
        except FileNotFoundError:
            pass
    return total


def _run_writers(root: Path, mode: str, n: int = 24, procs: int = 4) -> tuple[int, int, list[dict[str, int]], int]:
    """Run ``procs`` writer processes at once; sample the directory's size every
    50 ms under the tier's lock. Returns (peak, samples, results, final size)."""
    open_disk(root, max_size=BUDGET).close()  # create the tier (and its usage file)
    go = root.parent / f"go-{mode}"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(n), str(go), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(procs)
    ]
    peak, samples = 0, 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak, samples
        fd = os.open(root / USAGE, os.O_RDONLY)
        try:
            while not stop.is_set():
                fcntl.flock(fd, fcntl.LOCK_EX)  # the writers change files only under this lock
                try:
                    peak = max(peak, _dir_bytes(root))
                    samples += 1
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                stop.wait(0.05)
        finally:
            os.close(fd)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(0.5)
    go.touch()
    results = []
    try:
        for c in children:
            out, err = c.communicate(timeout=120)
            assert c.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
        stop.set()
        sampler.join(timeout=10)
    return peak, samples, results, _dir_bytes(root)


def test_four_processes_share_one_directory_budget(tmp_path: Path) -> None:
    """Figures: peak directory size over all samples <= 8 MiB with 4 writers of
    24 x 512 KiB each (48 MiB written); the shared count equals the bytes on disk at
    the end; the writers still store (>= 90% of puts); no read returns wrong data,
    and the last writer to finish reads back all of its 4 newest chunks (the others'
    may have been evicted by writers that went on)."""
    root = tmp_path / "shared"
    peak, samples, results, final = _run_writers(root, "budget")
    print(json.dumps({"peak_mib": peak / 2**20, "final_mib": final / 2**20, "samples": samples, "results": results}))
    assert samples >= 5
    assert peak <= BUDGET and final <= BUDGET, (peak, final)
    assert final > BUDGET // 2  # the directory is used, not emptied
    assert sum(r["ok"] for r in results) >= 0.9 * 4 * 24
    assert all(r["wrong"] == 0 for r in results) and max(r["recent_hits"] for r in results) == 4, results
    with open(root / USAGE, "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] == final
    # A restart recounts: the count stays equal to what is on disk.
    b = open_disk(root, max_size=BUDGET)
    assert b.stats().extra["dir_bytes"] == final
    b.close()


def test_negative_control_without_eviction_the_probe_sees_the_overshoot(tmp_path: Path) -> None:
    """The same writer and probe with eviction disabled in the child (24 x 512 KiB
    = 12 MiB): the probe reports well over the budget, so the test above could fail."""
    peak, samples, results, final = _run_writers(tmp_path / "shared", "no-budget", procs=1)
    print(json.dumps({"peak_mib": peak / 2**20, "final_mib": final / 2**20, "samples": samples}))
    assert all(r["ok"] == 24 for r in results)
    assert peak > 1.4 * BUDGET and final > 1.4 * BUDGET


def test_a_hung_lock_holder_makes_puts_fail_in_bounded_time(tmp_path: Path) -> None:
    """Another holder of the budget lock (a stopped process) costs a put at most the
    lock timeout; the put fails cleanly (no temp left) and reads go on."""
    root = tmp_path / "t"
    b = open_disk(root)
    key, data = random_key(), random_chunk(SHAPE, seed=5)
    assert b.put(key, data)
    assert b._budget is not None
    b._budget.timeout = 0.3
    fd = os.open(root / USAGE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a separate open file: excludes the tier like another process
        t0 = time.perf_counter()
        assert b.put(random_key(), data) is False
        waited = time.perf_counter() - t0
        assert 0.25 <= waited < 2.0, waited
        assert b.stats().extra["write_errors"] == 1
        out = torch.empty_like(data)
        assert b.get(key, out) and torch.equal(out, data)
    finally:
        os.close(fd)  # releases the lock
    assert b.put(random_key(), data)
    leftovers = [p for p in root.glob("*/.tmp-*")]
    assert leftovers == []
    b.close()


def test_a_damaged_usage_file_is_recounted_not_trusted(tmp_path: Path) -> None:
    """A flipped byte in the shared count (a stray write, a fault injector) is
    detected (the file holds the count and its complement) and repaired from a
    listing at the next put: nothing is evicted for it and the count is exact."""
    root = tmp_path / "t"
    b = open_disk(root, max_size=1 << 20)
    keys = [random_key() for _ in range(4)]
    for i, k in enumerate(keys):
        assert b.put(k, random_chunk(SHAPE, seed=10 + i))
    usage = root / USAGE
    raw = bytearray(usage.read_bytes())
    raw[6] ^= 0xFF  # the count's high bytes: would claim ~2**50 bytes
    usage.write_bytes(bytes(raw))
    assert b.put(random_key(), random_chunk(SHAPE, seed=20))
    assert b.contains(keys) == 4 and b.stats().evictions == 0
    assert struct.unpack("<Q", usage.read_bytes()[:8])[0] == _dir_bytes(root)
    b.close()
