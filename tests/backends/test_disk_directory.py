"""The disk tier's directory is shared and not trusted: whatever else is in it (damaged
or planted files, links, non-regular entries, junk names, other processes writing
the same directory) ends as a miss or is left alone, never a hang, a failed start,
a wrong hit or a broken budget. Real files, FIFOs, processes and the real lock.

- Entries: every chunk open is non-blocking and ``fstat``-checked, so a FIFO, socket,
  device node or directory under a chunk name is a miss (``not_regular``) and is
  removed, in ``get``, ``get_many``, the whole-frame path and an engine retrieve,
  while a regular valid file still hits; a put over one replaces it. A chunk file
  whose header holds malformed numbers (``Infinity`` offsets, a 2**70 length) never
  fails a start (``verify_on_start``) and is a removed miss. No symbolic link is
  followed: a shard replaced by a link is never entered (start-up deletes nothing
  there, puts never land there), a link under a chunk or temp name is neither read
  nor deleted, and files the tier did not name are never deleted.
- The budget: ``max_size`` holds for the directory, shared by every process (4
  processes writing 512 KiB chunks at once, each with ``max_size: 8MiB``, never make
  it exceed 8 MiB, sampled every 50 ms under the tier's own lock; a negative control
  with eviction disabled in the child shows the same probe seeing the overshoot). A
  temp file reserves bytes only when a live process that has this tier open writes
  it, its size is at most ``max_size`` and its mtime is sane (planted temps with a
  future mtime or a huge declared size disable nothing). A damaged usage file, or one
  of the older layout, is recounted rather than trusted; a busy shard keeps its count
  exact. A hung holder of the budget lock makes puts fail in bounded time, and the
  lock is never held for a listing (200k junk names: another instance's puts during
  the scan all succeed).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_backend_disk.directory import FANOUT, USAGE
from lmcache_backend_disk.fileio import read_whole, write_parts
from lmcache_backend_disk.frames import check_frame_file
from lmcache_core.config import load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import ChunkKey, KeyNamespace
from lmcache_core.serde import encode
from lmcache_core.testing import make_context, random_chunk, random_key
from lmcache_core.testing.tokens import retrieve_tokens, store_tokens, token_hashes

SHAPE = (16, 64)  # 2 KiB of float16
JOIN_S = 20.0  # a call that has not returned by then hangs


def open_disk(path: Path, **opts: Any) -> DiskBackend:
    b = create_disk_backend({"path": str(path), "max_size": "64MiB", "fsync": False, **opts}, make_context())
    assert b.wait_for_scan(120)
    return b


def _unblock(path: Path) -> None:
    """Release a reader stuck opening the FIFO ``path`` (the code before the fix):
    a writer that opens and closes it ends the reader's open with EOF."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def bounded(call: Callable[[], Any], fifo: Path | None = None) -> Any:
    """Run ``call`` in a thread; fail (not hang) when it has not returned after
    :data:`JOIN_S`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # handed to the test
            box["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(JOIN_S)
    hung = t.is_alive()
    while fifo is not None and t.is_alive():  # leave no thread stuck in open() behind
        _unblock(fifo)
        t.join(0.2)
    assert not hung, f"the call did not return within {JOIN_S} s (blocked on a FIFO?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def same_shard_key(key: ChunkKey) -> ChunkKey:
    other = random_key()
    while other.chunk_hash[:1] != key.chunk_hash[:1]:
        other = random_key()
    return other


# -- non-regular entries under chunk names -----------------------------------------------------
def _plant(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o644)
    elif kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # the null device
    elif kind == "directory":
        path.mkdir()
    else:
        raise AssertionError(kind)


KINDS = ["fifo", "socket", "directory"] + (["device"] if os.geteuid() == 0 else [])


def test_fifo_under_a_chunk_name_ten_gets_all_return_as_misses(tmp_path: Path) -> None:
    """The attack: 10 reads of a key whose file is a FIFO. Each returns (a miss)
    within the join timeout, the FIFO is removed each time (planted again for the
    next), and ``not_regular`` counts 10. Negative control: the neighbour key, a
    regular valid file in the same shard, hits every time."""
    b = open_disk(tmp_path / "t")
    key, data = random_key(), random_chunk(SHAPE, seed=1)
    good_k = same_shard_key(key)
    assert b.put(good_k, data)
    fifo = b.directory.chunk_path(key)
    try:
        for _ in range(10):
            if not fifo.exists():
                os.mkfifo(fifo)
            assert bounded(lambda: b.get(key, torch.empty_like(data)), fifo) is False
            assert not fifo.exists()
            out = torch.empty_like(data)
            assert b.get(good_k, out) and torch.equal(out, data)
        x = b.stats()
        assert x.extra["not_regular"] == 10 and x.hits == 10
    finally:
        _unblock(fifo)
        b.close()


@pytest.mark.parametrize("kind", KINDS)
def test_non_regular_entries_are_misses_in_get_and_get_many(tmp_path: Path, kind: str) -> None:
    """``get_many`` (the engine's batched load) with FIFOs and the like under some
    chunk names: those are misses, removed; the regular file among them hits."""
    b = open_disk(tmp_path / "t")
    good_k, data = random_key(), random_chunk(SHAPE, seed=2)
    assert b.put(good_k, data)
    odd_keys = [random_key() for _ in range(3)]
    paths = [b.directory.chunk_path(k) for k in odd_keys]
    for p in paths:
        _plant(kind, p)
    try:
        keys = [odd_keys[0], good_k, odd_keys[1], odd_keys[2]]
        outs = [torch.zeros_like(data) for _ in keys]
        got = bounded(lambda: b.get_many(keys, outs), paths[0] if kind == "fifo" else None)
        assert got == [False, True, False, False] and torch.equal(outs[1], data)
        assert not any(os.path.lexists(p) for p in paths)
        assert b.stats().extra["not_regular"] == 3
    finally:
        for p in paths:
            if kind == "fifo":
                _unblock(p)
        b.close()


def test_whole_frame_path_and_frame_check_refuse_a_fifo(tmp_path: Path) -> None:
    """The other opens of a chunk file: the whole-frame read (``get`` of a non-raw
    codec or a non-contiguous tensor opens the file a second time, which a FIFO may
    have replaced) and the start-up scan's header check; and a temp file that became
    a FIFO before the write opens it (no reader: that open would wait for one)."""
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "chunk")
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:  # NotRegularFile (an OSError with the entry's lstat as .st)
        with pytest.raises(OSError) as err:
            bounded(lambda: read_whole("chunk", dir_fd=dfd, o_direct=False, max_bytes=1 << 20), d / "chunk")
        assert stat.S_ISFIFO(err.value.st.st_mode)  # type: ignore[attr-defined]
        with pytest.raises(OSError) as err:
            bounded(lambda: check_frame_file("chunk", 100, "chunk", dir_fd=dfd), d / "chunk")
        assert stat.S_ISFIFO(err.value.st.st_mode)  # type: ignore[attr-defined]
        os.mkfifo(d / ".tmp-1-00000000000000aa-10")
        with pytest.raises(OSError) as err:
            bounded(
                lambda: write_parts(
                    ".tmp-1-00000000000000aa-10",
                    dir_fd=dfd,
                    header_len=2,
                    payload=memoryview(b"xxxxxxxx"),
                    make_header=lambda: b"hh",
                    fsync=False,
                ),
            )
        assert stat.S_ISFIFO(err.value.st.st_mode)  # type: ignore[attr-defined]
        # negative control: a regular file is read
        (d / "plain").write_bytes(b"abc")
        buf, _ = read_whole("plain", dir_fd=dfd, o_direct=False, max_bytes=1 << 20)
        assert bytes(buf) == b"abc"
    finally:
        _unblock(d / "chunk")
        os.close(dfd)


def test_lz4_tier_get_of_a_fifo_is_a_miss(tmp_path: Path) -> None:
    """A tier whose frames take the whole-frame path (lz4): same outcome."""
    b = create_disk_backend({"path": str(tmp_path / "t"), "max_size": "64MiB", "fsync": False}, make_context(codec="lz4"))
    assert b.wait_for_scan(60)
    key, data = random_key(), random_chunk(SHAPE, seed=3)
    good_k = same_shard_key(key)
    assert b.put(good_k, data)
    fifo = b.directory.chunk_path(key)
    os.mkfifo(fifo)
    try:
        assert bounded(lambda: b.get(key, torch.empty_like(data)), fifo) is False
        out = torch.empty_like(data)
        assert b.get(good_k, out) and torch.equal(out, data)
    finally:
        _unblock(fifo)
        b.close()


def test_put_over_a_fifo_replaces_it_and_the_scan_removes_planted_ones(tmp_path: Path) -> None:
    root = tmp_path / "t"
    b = open_disk(root)
    key, data = random_key(), random_chunk(SHAPE, seed=4)
    fifo = b.directory.chunk_path(key)
    os.mkfifo(fifo)
    assert bounded(lambda: b.put(key, data), fifo)  # the FIFO goes, the chunk is stored
    out = torch.empty_like(data)
    assert b.get(key, out) and torch.equal(out, data)
    b.close()
    # start-up: FIFOs under a chunk name and a temp name, a link under a chunk name
    planted = [b.directory.chunk_path(random_key()), b.directory.shard(key) / ".tmp-1-00000000000000aa-10"]
    for p in planted:
        os.mkfifo(p)
    link = b.directory.chunk_path(random_key())
    link.symlink_to(fifo)
    b2 = open_disk(root)
    try:
        x = b2.stats().extra
        assert x["scan_state"] == "complete" and x["startup_not_regular"] == 2
        assert not any(os.path.lexists(p) for p in planted)
        assert link.is_symlink()  # links are never deleted
        assert b2.get(key, out) and torch.equal(out, data)
    finally:
        for p in planted:
            _unblock(p)
        b2.close()


def test_engine_retrieve_with_a_fifo_under_a_chunk_name_returns(tmp_path: Path) -> None:
    """The hang as a user met it: an engine retrieve (``retrieve_tokens``) of a
    prefix whose second chunk's file is a FIFO, 10 times (the FIFO planted again
    each time): every call returns within the join timeout with the first chunk
    loaded, right."""
    chunk = 256
    shape = (2, 2, chunk, 4, 16)
    cfg = load_config(
        overrides={"chunk_size": chunk, "backends": [{"name": "disk", "path": str(tmp_path / "disk"), "fsync": False}]}
    )
    e = CacheEngine(cfg, namespace=KeyNamespace(model="m"))
    tokens = list(range(3 * chunk))
    chunks = [torch.full(shape, float(i + 1), dtype=torch.float16) for i in range(3)]
    fifo: Path | None = None
    try:
        assert store_tokens(e, tokens, chunks) == 3 and e.flush(timeout=60)
        disk = e.tiers[-1]
        assert isinstance(disk, DiskBackend)
        fifo = disk.directory.chunk_path(e.keys(token_hashes(e, tokens))[1])
        fifo.unlink()
        loaded = []
        for _ in range(10):
            if not fifo.exists():
                os.mkfifo(fifo)
            outs = [torch.zeros(shape, dtype=torch.float16) for _ in range(3)]
            loaded.append(bounded(lambda: retrieve_tokens(e, tokens, outs), fifo))
            assert torch.equal(outs[0], chunks[0])
        assert loaded == [1] * 10
    finally:
        if fifo is not None:
            _unblock(fifo)
        e.close()


# -- planted temp names ------------------------------------------------------------------------
HOLDER = r"""
import sys
from lmcache_backend_disk import create_disk_backend
from lmcache_core.testing import make_context
b = create_disk_backend({"path": sys.argv[1], "max_size": sys.argv[2]}, make_context())
b.wait_for_scan(60)
print("open", flush=True)
sys.stdin.read()
b.close()
"""


class Holder:
    """A live process that has the tier open (the positive control: its temps count)."""

    def __init__(self, root: Path, max_size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(root), str(max_size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "open"
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.communicate("", timeout=60)


def _dir_bytes(root: Path) -> int:
    total = 0
    for shard in FANOUT:
        with os.scandir(root / shard) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _usage(root: Path) -> int:
    return struct.unpack("<Q", (root / USAGE).read_bytes()[:8])[0]


def _filled(root: Path, n: int = 8, max_size: int = 1 << 20) -> list[tuple[ChunkKey, torch.Tensor]]:
    b = open_disk(root, max_size=max_size)
    stored = [(random_key(), random_chunk(SHAPE, seed=100 + i)) for i in range(n)]
    for k, d in stored:
        assert b.put(k, d)
    b.close()
    return stored


def _all_hit(b: DiskBackend, stored: list[tuple[ChunkKey, torch.Tensor]]) -> bool:
    for k, d in stored:
        out = torch.empty_like(d)
        if not (b.get(k, out) and torch.equal(out, d)):
            return False
    return True


def _future(path: Path, days: int = 365) -> None:
    t = time.time() + days * 86400
    os.utime(path, (t, t))


@pytest.mark.parametrize(
    "name",
    [
        ".tmp-1-0123456789abcdef-99999999999999999999",  # pid 1, 20 digits (under 2**64 * 6)
        ".tmp-1-0123456789abcdef-1048576",  # exactly max_size, from a process that is not a tier's
        f".tmp-1-x-{10**25}",  # raised struct.error in the scan before
        f".tmp-1-0123456789abcdef-{10**25}",
        ".tmp-" + "9" * 200 + "-0123456789abcdef-1",  # a 200-digit pid (os.kill: OverflowError)
    ],
)
def test_planted_temp_with_future_mtime_disables_nothing(tmp_path: Path, name: str) -> None:
    """The attack: an empty temp name, pid 1, declaring a huge (or the whole) budget,
    mtime a year ahead. At the next start nothing is evicted, the scan completes, the
    count is the chunk files' bytes, puts are stored, and the planted name is gone."""
    root = tmp_path / "t"
    stored = _filled(root)
    shard = root / FANOUT[7]
    planted = shard / name
    planted.write_bytes(b"")
    _future(planted)
    b = open_disk(root, max_size=1 << 20)
    try:
        x = b.stats().extra
        assert x["scan_state"] == "complete" and x["startup_stale_temps"] == 1, x
        assert not planted.exists()
        assert _all_hit(b, stored) and b.stats().evictions == 0
        assert x["dir_bytes"] == _dir_bytes(root) == _usage(root)
        more = [(random_key(), random_chunk(SHAPE, seed=200 + i)) for i in range(4)]
        assert all(b.put(k, d) for k, d in more) and b.stats().skipped == 0
        assert _all_hit(b, stored + more)
    finally:
        b.close()


def test_temp_names_that_are_not_ours_are_left_alone(tmp_path: Path) -> None:
    """Names outside the temp namespace (a non-ASCII digit, which int() refuses for
    some characters) are foreign files: kept, never parsed, never fail the scan."""
    root = tmp_path / "t"
    stored = _filled(root)
    odd = [root / FANOUT[3] / ".tmp-\u00b2-0123456789abcdef-10", root / FANOUT[3] / ".tmp-x-1"]
    for p in odd:
        p.write_bytes(b"x")
    b = open_disk(root, max_size=1 << 20)
    try:
        assert b.stats().extra["scan_state"] == "complete" and all(p.exists() for p in odd)
        assert _all_hit(b, stored)
    finally:
        b.close()


def test_only_live_tier_processes_temps_count(tmp_path: Path) -> None:
    """Positive control, and the cases in between: a temp of a live process that has
    the tier open counts its declared size and is kept; the same name from a live
    process that does not (this test's parent), from this process without a write in
    flight, from the holder with a size over ``max_size`` or a future mtime, does not
    count (and, except the oversized one of the live holder, is removed)."""
    root = tmp_path / "t"
    budget = 1 << 20
    stored = _filled(root, max_size=budget)
    chunk_bytes = _dir_bytes(root)
    holder = Holder(root, budget)
    shard = root / FANOUT[9]
    try:
        live = shard / f".tmp-{holder.pid}-00000000000000a1-4096"
        oversized = shard / f".tmp-{holder.pid}-00000000000000a2-{budget + 1}"
        future = shard / f".tmp-{holder.pid}-00000000000000a3-4096"
        not_a_tier = shard / f".tmp-{os.getppid()}-00000000000000a4-4096"
        mine = shard / f".tmp-{os.getpid()}-00000000000000a5-4096"
        for p in (live, oversized, future, not_a_tier, mine):
            p.write_bytes(b"")
        _future(future)
        b = open_disk(root, max_size=budget)
        try:
            x = b.stats().extra
            assert x["startup_stale_temps"] == 3, x
            assert live.exists() and oversized.exists()
            assert not future.exists() and not not_a_tier.exists() and not mine.exists()
            assert x["dir_bytes"] == chunk_bytes + 4096 == _usage(root)
            assert _all_hit(b, stored)
        finally:
            b.close()
    finally:
        holder.close()
    # the holder is gone: its temps are leftovers now
    b = open_disk(root, max_size=budget)
    try:
        assert not live.exists() and not oversized.exists()
        assert b.stats().extra["dir_bytes"] == chunk_bytes == _usage(root)
    finally:
        b.close()


def test_a_usage_file_of_the_older_layout_is_recounted_once_under_the_lock(tmp_path: Path) -> None:
    """A 16-byte usage file (written by an older version, here with a wrong count)
    has no per-shard table: the start-up recount lists with the lock held, once, and
    writes the table; the count is then exact."""
    root = tmp_path / "t"
    _filled(root)
    (root / USAGE).write_bytes(struct.pack("<QQ", 12345, 12345 ^ ((1 << 64) - 1)))
    b = open_disk(root, max_size=1 << 20)
    try:
        assert b.stats().extra["dir_bytes"] == _dir_bytes(root) == _usage(root)
        assert len((root / USAGE).read_bytes()) == 16 + 8 + 2 * 256 * 8  # total, magic, 256 x (count, generation)
    finally:
        b.close()


# -- junk names and the budget lock -------------------------------------------------------------
JUNK = 200_000


def _listing_time(shard: Path) -> float:
    """What the recount used to do under the lock for the junk: an lstat per entry."""
    t0 = time.perf_counter()
    dfd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for e in os.scandir(dfd):
            os.stat(e.name, dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)
    return time.perf_counter() - t0


def test_junk_names_never_hold_the_budget_lock_for_a_listing(tmp_path: Path) -> None:
    """200k junk names in one shard. While a new instance A scans the directory: a
    prober (its own open file, so the flock excludes it like another process) takes
    the lock over and over and records its longest wait, and another instance B
    stores chunks with a lock timeout of a quarter of the junk's listing time. The
    longest wait stays under half the listing (a lock held for the listing is waited
    for the whole of it: 1.1 s against 0.8 s here), every put of B succeeds, some during A's recount
    (the positive control that they overlapped), and the count is exact afterwards."""
    root = tmp_path / "t"
    stored = _filled(root, max_size=64 << 20)
    b = open_disk(root)  # B: opened before the junk, its own scan is over
    shard = root / FANOUT[0]
    dfd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(JUNK):
            os.close(os.open(f"junk-{i:07d}", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=dfd))
    finally:
        os.close(dfd)
    ref = min(_listing_time(shard) for _ in range(2))
    assert b._budget is not None
    b._budget.timeout = ref / 4

    waits: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        fd = os.open(root / USAGE, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                fcntl.flock(fd, fcntl.LOCK_EX)
                waits.append(time.perf_counter() - t0)
                fcntl.flock(fd, fcntl.LOCK_UN)
                time.sleep(0.001)
        finally:
            os.close(fd)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    a = create_disk_backend({"path": str(root), "max_size": "64MiB", "fsync": False}, make_context())
    results: list[tuple[str, bool]] = []
    try:
        deadline = time.monotonic() + 120
        i = 0
        while not a.wait_for_scan(0) and time.monotonic() < deadline:
            state = a.stats().extra["scan_state"]
            ok = b.put(random_key(), random_chunk(SHAPE, seed=1000 + i))
            results.append((state, ok))
            i += 1
        assert a.wait_for_scan(0)
        x = a.stats().extra
    finally:
        stop.set()
        prober.join(30)
        a.close()
    longest = max(waits)
    print(f"junk={JUNK} listing={ref:.3f}s longest_lock_wait={longest:.4f}s puts={len(results)} scan_s={x['scan_s']}")
    assert x["scan_state"] == "complete" and x["startup_foreign_kept"] >= JUNK
    assert sum(1 for state, _ in results if state == "trimming") >= 1, results[-5:]
    assert all(ok for _, ok in results), [r for r in results if not r[1]][:5]
    # A lock held for a listing makes the prober wait the whole listing (>= ref); half of
    # it leaves room for a loaded machine's scheduling (B's puts, with a quarter as their
    # lock timeout, all succeeded above).
    assert longest < ref / 2, (longest, ref)
    assert b.stats().extra["write_errors"] == 0
    assert _usage(root) == _dir_bytes(root)
    assert _all_hit(b, stored)
    b.close()


def test_a_busy_shard_keeps_its_count_and_the_count_stays_exact(tmp_path: Path) -> None:
    """Instance B writes into one shard without pause while A recounts: A lists that
    shard again when its generation moved (or leaves it to the writers), and the count
    is exact afterwards either way."""
    root = tmp_path / "t"
    _filled(root, max_size=64 << 20)
    b = open_disk(root)
    target = random_key().chunk_hash[:1]
    keys = []
    while len(keys) < 400:
        k = random_key()
        if k.chunk_hash[:1] == target:
            keys.append(k)
    done = threading.Event()

    def write() -> None:
        for i, k in enumerate(keys):
            if done.is_set():
                return
            assert b.put(k, random_chunk((4, 16), seed=i))
            if i % 2:
                b.remove(keys[i - 1])

    w = threading.Thread(target=write)
    w.start()
    try:
        a = open_disk(root)
        a.close()
    finally:
        done.set()
        w.join(60)
    assert _usage(root) == _dir_bytes(root)
    b.close()


def test_not_regular_errno_set_is_what_linux_gives(tmp_path: Path) -> None:
    """What open() of a socket file gives (the reason open_regular asks lstat)."""
    sock = tmp_path / "s"
    os.mknod(sock, stat.S_IFSOCK | 0o644)
    with pytest.raises(OSError) as err:
        os.open(sock, os.O_RDONLY | os.O_NONBLOCK)
    assert err.value.errno == errno.ENXIO


# -- damaged headers, links, and several processes on one budget -------------------------


def open_synced(path: Path, **opts: Any) -> DiskBackend:
    """:func:`open_disk` with ``fsync`` as configured (on by default)."""
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
    b = open_synced(tmp_path / "t")
    good_k, good = random_key(), random_chunk(SHAPE, seed=1)
    bad_k, bad = random_key(), random_chunk(SHAPE, seed=2)
    assert b.put(good_k, good) and b.put(bad_k, bad)
    bad_file = b.directory.chunk_path(bad_k)
    b.close()
    bad_file.write_bytes(_malformed(encode(bad_k, bad, make_context().codec), offsets))
    b2 = open_synced(tmp_path / "t")  # verify_on_start: the start must not fail
    assert b2.stats().extra["startup_bad_removed"] == 1 and not bad_file.exists()
    out = torch.empty_like(good)
    assert b2.get(good_k, out) and torch.equal(out, good)
    b2.close()
    # Without the start-up check the first get finds it: a miss, and removed.
    bad_file.write_bytes(_malformed(encode(bad_k, bad, make_context().codec), offsets))
    b3 = open_synced(tmp_path / "t", verify_on_start=False)
    assert b3.get(bad_k, torch.empty_like(bad)) is False
    assert not bad_file.exists() and b3.stats().extra["corrupt_removed"] == 1
    b3.close()


# -- symbolic links and files the tier did not name -----------------------------------------
def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: (os.readlink(p).encode() if p.is_symlink() else p.read_bytes()) for p in sorted(d.iterdir())}


def test_symlinked_shard_is_never_entered(tmp_path: Path) -> None:
    root = tmp_path / "t"
    b = open_synced(root)
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

    b2 = open_synced(root)  # start-up scan with verify_on_start
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
    b = open_synced(root, max_size=1 << 20)
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
    b2 = open_synced(root, max_size=1 << 20)  # start-up scan: the links are not ours
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


def _dir_bytes_live(root: Path) -> int:
    """Bytes of every entry in the shards, while other processes add and delete them."""
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
    open_synced(root, max_size=BUDGET).close()  # create the tier (and its usage file)
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
                    peak = max(peak, _dir_bytes_live(root))
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
    return peak, samples, results, _dir_bytes_live(root)


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
    b = open_synced(root, max_size=BUDGET)
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
    b = open_synced(root)
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
    b = open_synced(root, max_size=1 << 20)
    keys = [random_key() for _ in range(4)]
    for i, k in enumerate(keys):
        assert b.put(k, random_chunk(SHAPE, seed=10 + i))
    usage = root / USAGE
    raw = bytearray(usage.read_bytes())
    raw[6] ^= 0xFF  # the count's high bytes: would claim ~2**50 bytes
    usage.write_bytes(bytes(raw))
    assert b.put(random_key(), random_chunk(SHAPE, seed=20))
    assert b.contains(keys) == 4 and b.stats().evictions == 0
    assert struct.unpack("<Q", usage.read_bytes()[:8])[0] == _dir_bytes_live(root)
    b.close()
