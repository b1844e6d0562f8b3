"""Disk tier benchmark: throughput against plain files, and start-up time.

    python bench/bench_disk.py [--quick] [--dir DIR]

Write: the tier's ``put`` (frame header + payload checksummed while written, temp
file, fsync, rename, fsync dir) vs plain files holding the same bytes (write + fsync
each file). Tier and plain alternate chunk by chunk, so both meet the same disk
(a VM disk's speed drifts within seconds). Read: the tier's
``get`` (read the file, check header and checksum, copy into the caller's tensor) vs a
plain ``readinto`` of the same bytes into a preallocated buffer. Reads run twice:
"cold" after dropping the page cache (only possible as root; the output says whether
it happened) and "warm" from the page cache. Start-up: opening a tier directory that
holds many tiny chunk files (index rebuilt by scanning), with and without the header
check. Ratios are tier/plain throughput (1.0 = as fast as plain files).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lib.timing import drop_caches
from lmcache_backend_disk import DiskBackend, DiskConfig
from lmcache_backend_disk.directory import MARKER, MARKER_TEXT, TierDirectory
from lmcache_core.keys import KeyNamespace
from lmcache_core.serde import Lz4Codec, RawCodec, encode

CODECS = {"raw": RawCodec(), "lz4": Lz4Codec()}


def open_tier(root: Path, **opts: object) -> DiskBackend:
    cfg = DiskConfig(path=str(root), max_size=1 << 40, **opts)
    return DiskBackend(cfg, codec=CODECS["raw"], codecs=CODECS)


def _plain_write_one(path: Path, c: torch.Tensor) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(c.numpy()).cast("B")
        while mv.nbytes:
            mv = mv[os.write(fd, mv) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_read_one(path: Path, o: torch.Tensor) -> None:
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(o.numpy()).cast("B")
        got = 0
        while got < mv.nbytes:
            n = f.readinto(mv[got:])
            if not n:
                raise RuntimeError("short file")
            got += n


def _interleaved(n: int, tier_op, plain_op) -> tuple[float, float]:
    """Run chunk i through the tier and plain files back to back (alternating who
    goes first), so both meet the same disk state; total seconds of each."""
    tt = pt = 0.0
    for i in range(n):
        for who in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            (tier_op if who == 0 else plain_op)(i)
            if who == 0:
                tt += time.perf_counter() - t0
            else:
                pt += time.perf_counter() - t0
    return tt, pt


def throughput(base: Path, n: int, mib: int, repeat: int, o_direct: bool) -> list[tuple[str, float, float, str]]:
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, generator=g) for _ in range(n)]
    outs = [torch.empty_like(c) for c in chunks]
    total = n * (mib << 20) / 2**20
    ns = KeyNamespace(model="bench")
    rows: dict[str, list[tuple[float, float]]] = {"write": [], "read cold": [], "read warm": []}
    dropped = True

    for r in range(repeat):
        keys = [ns.key(os.urandom(16)) for _ in range(n)]
        tdir, pdir = base / f"tier{r}", base / f"plain{r}"
        pdir.mkdir(parents=True)
        tier = open_tier(tdir, o_direct=o_direct)

        def put(i: int) -> None:
            if not tier.put(keys[i], chunks[i]):
                raise RuntimeError("put failed")

        def get(i: int) -> None:
            if not tier.get(keys[i], outs[i]):
                raise RuntimeError("get missed")

        rows["write"].append(_interleaved(n, put, lambda i: _plain_write_one(pdir / f"{i}.bin", chunks[i])))
        dropped &= drop_caches()
        rows["read cold"].append(_interleaved(n, get, lambda i: _plain_read_one(pdir / f"{i}.bin", outs[i])))
        rows["read warm"].append(_interleaved(n, get, lambda i: _plain_read_one(pdir / f"{i}.bin", outs[i])))
        for i in range(n):  # the tier really returns the stored bytes
            get(i)
            assert torch.equal(outs[i], chunks[i])
        tier.close()
        shutil.rmtree(tdir)
        shutil.rmtree(pdir)
    out = []
    for name, times in rows.items():
        tt = statistics.median(t for t, _ in times)
        pt = statistics.median(p for _, p in times)
        note = "" if name != "read cold" else ("page cache dropped" if dropped else "page cache NOT dropped (not root)")
        out.append((name, total / tt, total / pt, note))
    return out


def make_files(root: Path, n: int) -> None:
    """``n`` tiny valid chunk files, written directly in the tier's layout."""
    root.mkdir(parents=True)
    (root / MARKER).write_text(MARKER_TEXT)
    layout = TierDirectory(root)
    ns = KeyNamespace(model="startup")
    t = torch.arange(16, dtype=torch.float32)
    for i in range(n):
        k = ns.key(i.to_bytes(16, "little"))
        p = layout.chunk_path(k)
        if i < 256:
            p.parent.mkdir(exist_ok=True)
        p.write_bytes(encode(k, t, CODECS["raw"]))


def startup(base: Path, n: int) -> list[tuple[str, float, float, int]]:
    root = base / "startup"
    t0 = time.perf_counter()
    make_files(root, n)
    print(f"(created {n} files in {time.perf_counter() - t0:.1f}s)", flush=True)
    rows = []
    for verify in (False, True):
        for cold in (False, True):
            if cold and not drop_caches():
                nan = float("nan")
                rows.append((f"verify_on_start={verify}, cold: cannot drop page cache (not root)", nan, nan, 0))
                continue
            t0 = time.perf_counter()
            tier = open_tier(root, verify_on_start=verify)
            dt = time.perf_counter() - t0
            tier.wait_for_scan()  # the index is built in the background (issue #23)
            indexed = time.perf_counter() - t0
            chunks = tier.stats().chunks
            tier.close()
            rows.append((f"verify_on_start={verify}, {'cold' if cold else 'warm'} cache", dt, indexed, chunks))
    shutil.rmtree(root)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 chunks, 10k start-up files, 1 repetition")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /var/tmp)")
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--files", type=int, default=None, help="files for the start-up test (default 100000)")
    ap.add_argument("--repeat", type=int, default=None)
    a = ap.parse_args()
    n = a.chunks or (16 if a.quick else 64)
    files = a.files or (10_000 if a.quick else 100_000)
    repeat = a.repeat or (1 if a.quick else 3)
    base = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=a.dir or "/var/tmp"))
    try:
        fs = os.statvfs(base)
        print(
            f"dir {base}  ({fs.f_bavail * fs.f_frsize / 2**30:.0f} GiB free), {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, python {sys.version.split()[0]}"
        )
        print(f"\nthroughput: {n} chunks x {a.chunk_mib} MiB, fsync on both sides, median of {repeat}")
        for o_direct in (False, True):
            rows = throughput(base, n, a.chunk_mib, repeat, o_direct)
            print(f"  tier o_direct={o_direct}")
            print(f"    {'op':<10} {'tier MiB/s':>11} {'plain MiB/s':>12} {'ratio':>6}  note")
            for name, t, p, note in rows:
                print(f"    {name:<10} {t:>11.0f} {p:>12.0f} {t / p:>6.2f}  {note}")
        print(f"\nstart-up with {files} chunk files present (io_threads=4)")
        for name, dt, indexed, chunks in startup(base, files):
            print(f"  {name:<40} created {dt:>6.3f} s, index complete {indexed:>7.2f} s  ({chunks} chunks indexed)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
