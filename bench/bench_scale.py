"""Cost at scale (issue #23): what grows with the number of cached chunks N and with
the prompt length, and what must not.

    python bench/bench_scale.py [--quick] [--max-n N] [--dir DIR] [--strict]
    python bench/bench_scale.py --cpu-tier [--quick]   # the CPU tier's per-entry figures only

For N = 1k, 10k, 100k (``--max-n 1000000`` adds 1M; ``--quick``: 1k and 10k) small
chunks (64 float16 = 128 B) it fills a CPU tier (a CPU-only engine) and a disk tier
directory (frames written directly, byte for byte what the tier writes) and prints:

* engine creation over the disk directory (a ``local_cpu`` + ``disk`` engine), with a
  cold page cache (``/proc/sys/vm/drop_caches`` = 3: pages, dentries, inodes, as root, else
  n/a; then an engine over a scratch directory brings this process's code back) and warm;
  time until the first disk hit is served (lookup + retrieve of one chunk) and until
  the disk index is complete (``wait_for_scan``), both from the start of creation;
* per-operation latencies in CPU microseconds of the calling thread (``thread_time``:
  the machine may be shared, CPU time is what other jobs disturb least; wall time is
  printed next to it): CPU tier ``put`` (tier) and ``store`` (engine, one chunk per
  call), CPU ``get_buffer``, disk ``contains`` (one key), disk ``get``, disk ``put``
  (no fsync), and an engine lookup of a 256-chunk prompt alternating CPU and disk
  (per chunk);
* memory per CPU-tier entry beyond the payload (RSS growth over N entries, pool
  memory touched beforehand) and RSS per disk index entry;
* key hashing of a 1M-token Python list.

Then the log-log slope of every per-operation latency against N (least squares over
the Ns), and of the lookup time against the prompt length (256 to 4096 chunks,
alternating tiers, at the largest N). Bar: creation <= 0.5 s at every N, slope
<= 0.1 against N for every per-operation latency, <= 1.05 against prompt length.
``--strict`` exits 1 when the bar is missed (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench_disk import drop_caches  # page cache, dentries and inodes (root only)
from lmcache_backend_disk.directory import MARKER, MARKER_TEXT, TierDirectory
from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.config import load_config
from lmcache_core.keys import chunk_hashes
from lmcache_core.serde import RawCodec, encode

NS = KeyNamespace(model="bench-scale")
SHAPE = (64,)
DTYPE = torch.float16
CHUNK = torch.arange(64, dtype=DTYPE)
OPS = 1000  # ops per pass
REPS = 5  # passes; the fastest counts (least disturbed by other jobs)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cold_cache(root: Path) -> None:
    """Drop the page cache (and dentries, inodes), then bring this process's own
    code back (an engine over a scratch directory): what stays cold is the tier's
    directory, as for a server starting over a cache it has not read yet. Without
    the second step the timing would mostly be torch's libraries paging back in."""
    drop_caches()
    scratch = root.parent / "scratch"
    disk_engine(scratch, 16).close()
    shutil.rmtree(scratch, ignore_errors=True)


def h(tag: str, i: int) -> bytes:
    return (tag.encode() + i.to_bytes(12, "little")).ljust(16, b"\0")[:16]


def per_op(fn: Callable[[int], object], n: int = OPS, reps: int = REPS) -> tuple[float, float]:
    """(CPU us, wall us) per call of ``fn(i)``, the fastest of ``reps`` passes of
    ``n`` calls (pass p calls ``fn`` with i in ``range(p * n, (p + 1) * n)``)."""
    best_c = best_w = math.inf
    for p in range(reps):
        gc.collect()
        c0, w0 = time.thread_time(), time.perf_counter()
        for i in range(p * n, (p + 1) * n):
            fn(i)
        best_c = min(best_c, (time.thread_time() - c0) / n * 1e6)
        best_w = min(best_w, (time.perf_counter() - w0) / n * 1e6)
    return best_c, best_w


def slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.maximum(np.asarray(ys, float), 1e-12))
    return float(np.polyfit(lx, ly, 1)[0])


def cpu_engine(n_chunks: int, eviction: str = "tinylfu") -> CacheEngine:
    size = max(64 << 20, n_chunks * 2 * 256 + (16 << 20))
    tier = {"name": "local_cpu", "max_size": size, "eviction": eviction}
    loaded = load_config(env={}, overrides={"chunk_size": 16, "staging_size": "16MiB", "backends": [tier]})
    return CacheEngine(loaded, namespace=NS)


def disk_engine(root: Path, n_chunks: int) -> CacheEngine:
    loaded = load_config(
        env={},
        overrides={
            "chunk_size": 16,
            "staging_size": "16MiB",
            "backends": [
                {"name": "local_cpu", "max_size": max(64 << 20, n_chunks * 256 + (8 << 20))},
                {"name": "disk", "path": str(root), "max_size": "1TiB", "fsync": False},
            ],
        },
    )
    return CacheEngine(loaded, namespace=NS)


def fill_disk(root: Path, start: int, stop: int) -> None:
    """Disk chunks ``d{start}..d{stop-1}`` as frame files in the tier's layout."""
    if not (root / MARKER).exists():
        root.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text(MARKER_TEXT)
        for i in range(256):
            (root / f"{i:02x}").mkdir(exist_ok=True)
    d = TierDirectory(root)
    codec = RawCodec()
    for i in range(start, stop):
        k = NS.key(h("d", i))
        d.chunk_path(k).write_bytes(encode(k, CHUNK, codec))


def memory_child(n: int, eviction: str, root: str) -> None:
    """(In a fresh interpreter, so freed memory of earlier steps does not hide
    growth.) Print the RSS growth per entry of a CPU tier going from ``n/2`` to ``n``
    chunks (pool memory touched first, so only the overhead counts; dict tables grow
    in steps, so this is noisy at small N) and of a disk tier's complete index over
    ``root`` (fixed costs included: meaningful at large N)."""
    eng = cpu_engine(n, eviction)
    eng.pool._data.fill_(0)
    hashes = [h("c", i) for i in range(n)]
    half = n // 2
    for i in range(0, half, 256):  # the first half pays the fixed costs (allocator arenas, first tables)
        eng.store_hashes(hashes[i : min(half, i + 256)], [CHUNK] * len(hashes[i : min(half, i + 256)]))
    gc.collect()
    before = rss()
    for i in range(half, n, 256):
        eng.store_hashes(hashes[i : i + 256], [CHUNK] * len(hashes[i : i + 256]))
    gc.collect()
    cpu = (rss() - before) / (n - half)  # marginal bytes per entry (the keys' hash bytes included)
    gc.collect()
    before = rss()
    d = disk_engine(Path(root), 1024)
    d.tiers[1].wait_for_scan()
    gc.collect()
    disk = (rss() - before) / n
    print(f"{cpu:.1f} {disk:.1f}")


def memory_per_entry(n: int, eviction: str, root: Path) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(n), eviction, str(root)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout.split()
    return float(out[-2]), float(out[-1])


def measure_cpu(n: int, eviction: str, r: dict[str, float]) -> None:
    """CPU tier put / engine store / get_buffer latencies with ``n`` entries (the
    engine is gone when this returns)."""
    eng = cpu_engine(n + 2 * OPS * REPS, eviction)
    tier = eng.tiers[0]
    hashes = [h("c", i) for i in range(n)]
    for i in range(0, n, 256):
        eng.store_hashes(hashes[i : i + 256], [CHUNK] * len(hashes[i : i + 256]))
    new = eng.keys([h("n", i) for i in range(OPS * REPS)])
    r["cpu_put_us"], r["cpu_put_wall_us"] = per_op(lambda i: tier.put(new[i], CHUNK))
    more = [h("m", i) for i in range(OPS * REPS)]
    r["cpu_store_us"], r["cpu_store_wall_us"] = per_op(lambda i: eng.store_hashes([more[i]], [CHUNK]))
    keys = eng.keys(hashes)
    step = max(1, n // OPS)
    r["cpu_get_us"], r["cpu_get_wall_us"] = per_op(lambda i: tier.get_buffer(keys[(i * step) % n]).release())
    eng.close()


def measure_n(n: int, root: Path, cold_ok: bool, eviction: str) -> dict[str, float]:
    r: dict[str, float] = {"N": n}
    step = max(1, n // OPS)
    r["cpu_bytes_per_entry"], r["disk_index_bytes_per_entry"] = memory_per_entry(n, eviction, root)
    measure_cpu(n, eviction, r)
    gc.collect()

    # -- disk tier: creation, first hit, index complete ---------------------------------
    extra_cold: list[float] = []
    for _ in range(2 if cold_ok else 0):  # creation alone, twice more: a shared disk stalls now and then
        cold_cache(root)
        t0 = time.perf_counter()
        e = disk_engine(root, 2 * OPS)
        extra_cold.append(time.perf_counter() - t0)
        e.close()
        del e
    for cold in (True, False):
        label = "cold" if cold else "warm"
        if cold and not cold_ok:
            r[f"create_{label}_s"] = r[f"first_hit_{label}_s"] = r[f"indexed_{label}_s"] = float("nan")
            continue
        if cold:
            cold_cache(root)
        gc.collect()
        t0 = time.perf_counter()
        eng = disk_engine(root, 2 * OPS)
        r[f"create_{label}_s"] = time.perf_counter() - t0
        first = [h("d", n // 2)]
        out = [torch.empty(SHAPE, dtype=DTYPE)]
        ok = eng.lookup_hashes(first) == 1 and eng.retrieve_hashes(first, out) == 1
        r[f"first_hit_{label}_s"] = time.perf_counter() - t0 if ok else float("nan")
        disk = eng.tiers[1]
        disk.wait_for_scan()
        r[f"indexed_{label}_s"] = time.perf_counter() - t0
        if cold:
            r["create_cold_s"] = sorted(extra_cold + [r["create_cold_s"]])[len(extra_cold) // 2 if extra_cold else 0]
        if not cold:
            # -- per-op latencies with the index complete ----------------------------------
            dkeys = eng.keys([h("d", (i * step) % n) for i in range(OPS * REPS)])
            r["disk_contains_us"], r["disk_contains_wall_us"] = per_op(lambda i: disk.contains([dkeys[i]]))
            o = torch.empty(SHAPE, dtype=DTYPE)
            r["disk_get_us"], r["disk_get_wall_us"] = per_op(lambda i: disk.get(dkeys[i], o))
            pkeys = eng.keys([h("p", n * 10 + i) for i in range(OPS * REPS)])
            r["disk_put_us"], r["disk_put_wall_us"] = per_op(lambda i: disk.put(pkeys[i], CHUNK))
            for k in pkeys:
                disk.remove(k)
            # lookup of a 256-chunk prompt alternating CPU / disk (CPU chunks stored now)
            cpu_h = [h("q", i) for i in range(128)]
            eng.store_hashes(cpu_h, [CHUNK] * 128)
            assert eng.flush(60)
            prompt = [x for i in range(128) for x in (cpu_h[i], h("d", (i * 7) % n))]
            for x in cpu_h:  # keep them out of the disk: the prompt alternates tiers
                disk.remove(eng.keys([x])[0])
            assert eng.lookup_hashes(prompt) == 256, "prompt not fully cached"
            c, w = per_op(lambda i: eng.lookup_hashes(prompt, record=False), n=10)
            r["lookup_per_chunk_us"], r["lookup_per_chunk_wall_us"] = c / 256, w / 256
        eng.close()
        eng = disk = None  # type: ignore[assignment]  # freed here, not inside the next timing
        gc.collect()
    return r


def lookup_vs_prompt(root: Path, n: int) -> list[tuple[int, float, float]]:
    """Lookup time of prompts alternating CPU and disk chunks, per prompt length."""
    eng = disk_engine(root, 8192)
    try:
        eng.tiers[1].wait_for_scan()
        disk = eng.tiers[1]
        rows = []
        lengths = [256, 1024, 4096] if n >= 2048 else [64, 256, 1024]
        cpu_h = [h("r", i) for i in range(max(lengths) // 2)]
        for i in range(0, len(cpu_h), 256):
            eng.store_hashes(cpu_h[i : i + 256], [CHUNK] * len(cpu_h[i : i + 256]))
        assert eng.flush(120)
        for k in eng.keys(cpu_h):
            disk.remove(k)
        for length in lengths:
            half = length // 2
            prompt = [x for i in range(half) for x in (cpu_h[i], h("d", i % n))]
            assert eng.lookup_hashes(prompt, record=False) == length
            c, w = per_op(lambda i: eng.lookup_hashes(prompt, record=False), n=max(1, 4096 // length))
            rows.append((length, c, w))
        return rows
    finally:
        eng.close()


def hashing() -> tuple[float, float]:
    toks = [(i * 7919) % 150000 for i in range(1_000_000)]
    best_list, best_np = 1e9, 1e9
    arr = np.asarray(toks, dtype=np.int64)
    for _ in range(3):
        t = time.thread_time()
        chunk_hashes(toks, 256)
        best_list = min(best_list, time.thread_time() - t)
        t = time.thread_time()
        chunk_hashes(arr, 256)
        best_np = min(best_np, time.thread_time() - t)
    return best_list * 1e3, best_np * 1e3


OPS_KEYS = [
    ("cpu_put_us", "CPU tier put"),
    ("cpu_store_us", "engine store (CPU tier, 1 chunk/call)"),
    ("cpu_get_us", "CPU tier get_buffer"),
    ("disk_contains_us", "disk contains (1 key)"),
    ("disk_get_us", "disk get"),
    ("disk_put_us", "disk put (no fsync)"),
    ("lookup_per_chunk_us", "lookup, 256 chunks CPU/disk alternating, per chunk"),
]


def cpu_tier_only(ns: list[int], where: str | None, strict: bool) -> int:
    """``--cpu-tier``: memory per entry (both policies, fresh interpreters) and the
    CPU tier's per-op latencies with the default policy, against the per-entry targets
    (<= 300 B beyond the payload, ``put`` <= 10 us at the largest N)."""
    base = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=where or "/var/tmp"))
    (base / "empty").mkdir()  # the memory child's disk tier (its figure is not printed here)
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; latencies: CPU time of the calling "
        f"thread per op (wall in brackets), fastest of {REPS} passes of {OPS} ops"
    )
    try:
        mem: dict[str, float] = {}
        r: dict[str, float] = {}
        for n in ns:
            for policy in ("tinylfu", "lru"):
                mem[policy] = memory_per_entry(n, policy, base / "empty")[0]
            r = {}
            measure_cpu(n, "tinylfu", r)
            print(f"N = {n:>9,}  memory beyond the payload: tinylfu {mem['tinylfu']:.0f} B/entry, lru {mem['lru']:.0f} B/entry")
            for k, name in OPS_KEYS[:3]:
                print(f"  {name:<52} {r[k]:8.2f} us  ({r[k.replace('_us', '_wall_us')]:.2f} wall)")
        ok_mem, ok_put = mem["tinylfu"] <= 300, r["cpu_put_us"] <= 10
        print(f"\nbar at N = {ns[-1]:,}")
        print(f"  {'PASS' if ok_mem else 'MISS'}  memory per CPU-tier entry (tinylfu) <= 300 B: {mem['tinylfu']:.0f} B")
        print(f"  {'PASS' if ok_put else 'MISS'}  CPU tier put <= 10 us: {r['cpu_put_us']:.2f} us")
        return 1 if strict and not (ok_mem and ok_put) else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 1k and 10k only")
    ap.add_argument("--max-n", type=int, default=None, help="largest N (default 100000; 1000000 adds 1M)")
    ap.add_argument("--dir", default=None, help="where the disk tier lives (default: a temp dir under /var/tmp)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the bar is missed")
    ap.add_argument("--eviction", default="tinylfu", help="the CPU tier's eviction policy (default tinylfu, the default)")
    ap.add_argument(
        "--cpu-tier",
        action="store_true",
        help="only the CPU tier's figures (memory per entry with tinylfu and lru, put / store / "
        "get_buffer) against their targets; about 2 minutes",
    )
    ap.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.memory_child:
        memory_child(int(a.memory_child[0]), a.memory_child[1], a.memory_child[2])
        return 0
    max_n = a.max_n or (10_000 if a.quick else 100_000)
    ns = [n for n in (1_000, 10_000, 100_000, 1_000_000) if n <= max_n]
    if a.cpu_tier:
        return cpu_tier_only(ns, a.dir, a.strict)
    base = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=a.dir or "/var/tmp"))
    root = base / "disk"
    cold_ok = drop_caches()
    print(
        f"dir {base}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}; cold page cache: {'yes (drop_caches)' if cold_ok else 'n/a (not root)'}"
    )
    print(f"latencies: CPU time of the calling thread per op (wall in brackets), fastest of {REPS} passes of {OPS} ops")
    rows = []
    have = 0
    try:
        for n in ns:
            t0 = time.perf_counter()
            fill_disk(root, have, n)
            have = n
            print(f"\nN = {n:,}  (disk filled in {time.perf_counter() - t0:.1f} s)", flush=True)
            r = measure_n(n, root, cold_ok, a.eviction)
            rows.append(r)
            print(f"  engine creation  cold {r['create_cold_s']:.3f} s (median of 3)  warm {r['create_warm_s']:.3f} s")
            print(
                f"  first disk hit   cold {r['first_hit_cold_s']:.3f} s  warm {r['first_hit_warm_s']:.3f} s"
                "  (from the start of creation)"
            )
            print(f"  index complete   cold {r['indexed_cold_s']:.3f} s  warm {r['indexed_warm_s']:.3f} s")
            for k, name in OPS_KEYS:
                print(f"  {name:<52} {r[k]:8.2f} us  ({r[k.replace('_us', '_wall_us')]:.2f} wall)")
            print(
                f"  memory beyond the payload: CPU tier ({a.eviction}) {r['cpu_bytes_per_entry']:.0f} B/entry; "
                f"disk index {r['disk_index_bytes_per_entry']:.0f} B/entry"
            )
        print("\nslopes (log-log) against N")
        worst = 0.0
        for k, name in OPS_KEYS:
            s = slope([r["N"] for r in rows], [r[k] for r in rows]) if len(rows) > 1 else float("nan")
            worst = max(worst, s) if not math.isnan(s) else worst
            print(f"  {name:<52} {s:+.3f}")
        for k in ("indexed_warm_s",):
            s = slope([r["N"] for r in rows], [r[k] for r in rows]) if len(rows) > 1 else float("nan")
            print(f"  {'index complete (background; expected ~1)':<52} {s:+.3f}")
        lv = lookup_vs_prompt(root, ns[-1])
        print(f"\nlookup against prompt length (CPU/disk alternating, N = {ns[-1]:,})")
        for length, c, w in lv:
            print(f"  {length:>5} chunks  {c / 1e3:8.3f} ms  ({w / 1e3:.3f} wall)  {c / length:.2f} us/chunk")
        s_prompt = slope([x[0] for x in lv], [x[1] for x in lv])
        print(f"  slope {s_prompt:+.3f}")
        hl, hn = hashing()
        print(f"\nhashing 1M tokens: from a Python list {hl:.1f} ms, from a numpy array {hn:.1f} ms (CPU time, best of 3)")
        create_max = max(max(r["create_warm_s"], 0 if math.isnan(r["create_cold_s"]) else r["create_cold_s"]) for r in rows)
        verdict = [
            ("engine creation <= 0.5 s at every N", create_max <= 0.5, f"max {create_max:.3f} s"),
            ("per-op slope against N <= 0.1", worst <= 0.1, f"worst {worst:+.3f}"),
            ("lookup slope against prompt length <= 1.05", s_prompt <= 1.05, f"{s_prompt:+.3f}"),
        ]
        print("\nbar")
        for name, ok, fig in verdict:
            print(f"  {'PASS' if ok else 'MISS'}  {name}: {fig}")
        return 1 if a.strict and not all(ok for _, ok, _ in verdict) else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
