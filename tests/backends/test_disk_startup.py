"""The disk tier's start-up does not wait for the directory scan, so a large directory
never delays an engine's start. The constructor returns while a background thread
indexes; chunks are served (and verified on read) during the scan; a kill -9 during it
loses nothing; the index it leaves keeps the LRU order (chunks used during the scan are
the most recent).

The scans here are slowed down with ``scan_rate`` so the checks really run while
the scan does (each test asserts that it was still running)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import lmcache_backend_disk.backend as disk_backend_mod
from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_backend_disk.directory import OWNERS, USAGE
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context

SHAPE = (64,)  # 128 bytes of float16: small chunks, many files
OURS = KeyNamespace(model="startup-ours")
THEIRS = KeyNamespace(model="startup-theirs")


def chunk(i: int) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float16) + float(i % 997)


def key(ns: KeyNamespace, i: int):
    return ns.key(i.to_bytes(16, "little"))


def open_disk(path: Path, **opts: object) -> DiskBackend:
    section = {"path": str(path), "max_size": "64MiB", "fsync": False, **opts}
    return create_disk_backend(section, make_context())


def fill(path: Path, ns: KeyNamespace, n: int, start: int = 0) -> None:
    b = open_disk(path)
    try:
        for i in range(start, start + n):
            assert b.put(key(ns, i), chunk(i))
    finally:
        b.close()


def read(b: DiskBackend, k, i: int) -> str:
    out = torch.full(SHAPE, -1.0, dtype=torch.float16)
    if not b.get(k, out):
        return "miss"
    return "right" if torch.equal(out, chunk(i)) else "WRONG"


def test_damaged_and_foreign_files_never_served_during_the_background_scan(tmp_path: Path) -> None:
    root = tmp_path / "t"
    fill(root, OURS, 200)
    fill(root, THEIRS, 100)  # another namespace's chunks (another model sharing the directory)
    probe = open_disk(root)
    path_of = probe.directory.chunk_path
    probe.close()
    flipped = list(range(0, 20))
    truncated = list(range(20, 40))
    impostor = list(range(40, 50))  # a valid frame of another key under this key's name
    for i in flipped:
        p = path_of(key(OURS, i))
        raw = bytearray(p.read_bytes())
        raw[-5] ^= 0x5A  # payload byte: only the checksum on read can tell
        p.write_bytes(bytes(raw))
    for i in truncated:
        p = path_of(key(OURS, i))
        p.write_bytes(p.read_bytes()[:-7])
    for j, i in enumerate(impostor):
        shutil.copy(path_of(key(THEIRS, j)), path_of(key(OURS, i)))

    t0 = time.perf_counter()
    b = open_disk(root, scan_rate=40)  # about 8 s to index 300 files: the checks run meanwhile
    try:
        created_s = time.perf_counter() - t0
        assert b.stats().extra["scan_state"] == "indexing"
        got = {i: read(b, key(OURS, i), i) for i in range(200)}
        theirs_seen = [read(b, key(THEIRS, j), j) for j in range(10, 100)]  # intact: kept and served to their owner
        s = b.stats()
        assert s.extra["scan_state"] == "indexing", "negative control: the scan must still be running"
        assert "WRONG" not in got.values()
        assert all(got[i] == "miss" for i in flipped + truncated + impostor)
        assert all(got[i] == "right" for i in range(50, 200))
        assert theirs_seen == ["right"] * 90
        assert s.extra["corrupt_removed"] == len(flipped) + len(truncated) + len(impostor)
        for i in flipped + truncated + impostor:
            assert not path_of(key(OURS, i)).exists() and b.contains([key(OURS, i)]) == 0
        assert b.contains([key(OURS, i) for i in range(50, 200)]) == 150
        assert created_s < 5  # generous: the point is it did not wait for the ~8 s scan
    finally:
        t_close = time.perf_counter()
        b.close()
        assert time.perf_counter() - t_close < 10  # close stops the scan between files
    assert b.stats().extra["scan_state"] == "stopped"


def test_scan_completes_with_progress_and_lru_order(tmp_path: Path) -> None:
    root = tmp_path / "t"
    fill(root, OURS, 60)
    b = open_disk(root, scan_rate=30)
    try:
        touched = key(OURS, 0)  # the oldest file: used during the scan, so most recent after it
        assert read(b, touched, 0) == "right"
        assert b.stats().extra["scan_state"] == "indexing"
        new = key(OURS, 1000)
        assert b.put(new, chunk(1000))
        assert b.wait_for_scan(30)
        x = b.stats().extra
        assert x["scan_state"] == "complete" and x["scan_files"] >= 60 and x["scan_shards_done"] == 256
        assert x["scan_index_s"] is not None and x["scan_s"] >= x["scan_index_s"]
        assert b.stats().chunks == 61 and b.index_complete
        order = b._index.keys_lru_first()
        assert set(order[-2:]) == {touched, new} and len(order) == 61
    finally:
        b.close()


def test_eviction_during_the_scan_takes_old_chunks_first(tmp_path: Path) -> None:
    root = tmp_path / "t"
    fill(root, OURS, 40)
    probe = open_disk(root)
    assert probe.wait_for_scan(30)
    per_file = probe.stats().bytes_used // 40
    probe.close()
    b = open_disk(root, max_size=per_file * 40, scan_rate=20)  # full: every put evicts
    try:
        time.sleep(1.0)  # some shards scanned
        assert b.stats().extra["scan_state"] == "indexing"
        for i in range(100, 105):
            assert b.put(key(OURS, i), chunk(i))
        for i in range(100, 105):
            assert read(b, key(OURS, i), i) == "right"  # the new chunks were not the victims
        assert b.stats().evictions >= 5
    finally:
        b.close()


_CHILD = r"""
import sys, time, torch
from lmcache_backend_disk import create_disk_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context
root = sys.argv[1]
b = create_disk_backend({"path": root, "max_size": "64MiB", "fsync": True, "scan_rate": 50}, make_context())
ns = KeyNamespace(model="startup-ours")
for i in range(5000, 5005):  # written during the scan
    assert b.put(ns.key(i.to_bytes(16, "little")), torch.arange(64, dtype=torch.float16) + float(i % 997))
print("state", b.stats().extra["scan_state"], b.stats().extra["scan_files"], flush=True)
time.sleep(60)
"""


def test_kill_9_during_the_background_scan_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "t"
    fill(root, OURS, 300)
    before = sorted(p.name for p in root.glob("??/v1-*"))
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert line[:2] == ["state", "indexing"], line  # negative control: killed mid-scan
        time.sleep(0.5)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    after = sorted(p.name for p in root.glob("??/v1-*"))
    assert set(before) <= set(after) and len(after) == len(before) + 5
    b = open_disk(root)
    try:
        assert b.wait_for_scan(60)
        assert b.stats().chunks == 305
        for i in list(range(300)) + list(range(5000, 5005)):
            assert read(b, key(OURS, i), i) == "right"
        assert b.stats().extra["dir_bytes"] == sum(f.stat().st_size for f in root.glob("??/v1-*"))
    finally:
        b.close()


def test_contains_never_stats_through_a_linked_shard(tmp_path: Path) -> None:
    """``contains`` stats a path relative to the tier directory (no directory open per
    key); a shard replaced by a symbolic link is refused before that, even while the
    background scan has not reached it. Negative control: the linked directory does
    hold the chunk's file, so a stat through the link would find it."""
    root = tmp_path / "t"
    b = open_disk(root)
    k = key(OURS, 7)
    assert b.put(k, chunk(7)) and b.contains([k]) == 1
    shard = b.directory.shard(k)
    b.close()
    outside = tmp_path / "elsewhere"
    shard.rename(outside)
    shard.symlink_to(outside, target_is_directory=True)
    assert (outside / b.directory.chunk_path(k).name).exists()
    b2 = open_disk(root, scan_rate=5)
    try:
        assert b2.contains([k]) == 0
        assert b2.stats().extra["links_refused"] >= 1
    finally:
        b2.close()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name not in (USAGE, OWNERS))


def _wait_for_trim(b: DiskBackend) -> None:
    deadline = time.monotonic() + 20
    while b.stats().extra["scan_state"] != "trimming":
        assert time.monotonic() < deadline, "the scan never reached its trim"
        time.sleep(0.005)


def _over_budget(root: Path) -> int:
    """Fill ``root`` with 40 chunks; a budget that holds about half of them."""
    fill(root, OURS, 40)
    probe = open_disk(root)
    assert probe.wait_for_scan(30)
    per_file = probe.stats().bytes_used // 40
    probe.close()
    return per_file * 20


def test_close_stops_a_waiting_trim_and_no_file_changes_after_it(tmp_path: Path) -> None:
    """The start-up trim waits for the budget lock (held here as another process
    would); close() stops it at once instead of waiting out the lock's timeout, and
    nothing is deleted after close, even once the lock is free."""
    root = tmp_path / "t"
    budget = _over_budget(root)
    before = _files(root)
    fd = os.open(root / USAGE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        b = open_disk(root, max_size=budget)
        _wait_for_trim(b)
        t0 = time.perf_counter()
        b.close()
        closed_s = time.perf_counter() - t0
        assert b._scan_thread is not None and not b._scan_thread.is_alive()
        assert b.stats().extra["scan_state"] == "stopped"
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert closed_s < 3, f"close waited {closed_s:.1f} s (the lock times out after 10 s)"
    time.sleep(0.3)
    assert _files(root) == before
    # negative control: the same start, not closed, trims to the budget
    b = open_disk(root, max_size=budget)
    try:
        assert b.wait_for_scan(30) and b.stats().extra["scan_state"] == "complete"
        assert len(_files(root)) <= 21 < len(before)
    finally:
        b.close()


def test_close_that_gives_up_waiting_leaves_the_directory_to_the_scan(tmp_path: Path, monkeypatch) -> None:
    """A scan that does not stop within CLOSE_WAIT_S (0 here) keeps the directory
    open until it ends, then closes it itself; it changes no file meanwhile."""
    monkeypatch.setattr(disk_backend_mod, "CLOSE_WAIT_S", 0.0)
    root = tmp_path / "t"
    budget = _over_budget(root)
    before = _files(root)
    fd = os.open(root / USAGE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        b = open_disk(root, max_size=budget)
        _wait_for_trim(b)
        b.close()
        assert b._close_deferred, "the scan was still waiting for the lock: close must have left it the directory"
        assert b._scan_done.wait(10)
        b._scan_thread.join(10)
        assert not b._scan_thread.is_alive()
        assert b._root_fd is None and b._budget is None  # closed by the scan thread as it ended
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    time.sleep(0.3)
    assert _files(root) == before


def test_count_only_listing_counts_exactly_what_the_full_listing_does(tmp_path: Path) -> None:
    """The recount at the end of the scan lists without making keys; it must count
    the same chunk files (and keep the same foreign ones) as the listing that does."""
    from lmcache_backend_disk.directory import parse_chunk_name
    from lmcache_backend_disk.scan import _CHUNK_NAME, _SHARD_AT, scan

    root = tmp_path / "t"
    fill(root, OURS, 60)
    fill(root, THEIRS, 20)
    probe = open_disk(root)
    good = probe.directory.chunk_path(key(OURS, 10))  # hex letters in both parts
    probe.close()
    shard = good.parent
    odd = [
        good.name.upper(),  # uppercase: not a name the tier writes
        good.name[:3] + good.name[3:35].upper() + good.name[35:],  # uppercase namespace hex only
        good.name[:36] + good.name[36:].upper(),  # uppercase chunk hex only
        good.name[:38] + "AB" + good.name[40:],  # uppercase after the shard's two characters
        good.name[:-1],  # too short
        good.name[:-2],
        good.name + "0",
        good.name.replace("v1-", "v2-"),
        good.name[:10] + " " + good.name[11:],  # bytes.fromhex would skip the space
        good.name[:3] + "-" + good.name[3:],  # an extra part
        "notes.txt",
    ]
    for name in odd:
        (shard / name).write_bytes(good.read_bytes())
    other = next(p for p in root.iterdir() if p.is_dir() and p.name != shard.name)
    (other / good.name).write_bytes(good.read_bytes())  # a chunk under the wrong shard
    for name in odd + [good.name]:
        for where in (shard.name, other.name):
            by_regex = _CHUNK_NAME.fullmatch(name) is not None and name[_SHARD_AT : _SHARD_AT + 2] == where
            assert by_regex == (parse_chunk_name(where, name) is not None), (name, where)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        full = scan(fd, str(root), verify=False, clean=False, pool=None)
        count = scan(fd, str(root), verify=False, clean=False, pool=None, keys=False)
    finally:
        os.close(fd)
    assert len(full.entries) == 80 and not count.entries
    assert count.chunk_bytes == full.chunk_bytes > 0
    assert count.foreign_kept == full.foreign_kept == len(odd) + 1
