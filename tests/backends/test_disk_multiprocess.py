"""Two real processes on one tier directory: one stores, the other hits; concurrent
writers of one key never leave a file that decodes to wrong data."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context

NS = KeyNamespace(model="mp")

_CHILD = r"""
import json, sys, torch
from lmcache_backend_disk import create_disk_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context
root, mode, arg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
b = create_disk_backend({"path": root, "max_size": "1GiB"}, make_context())
ns = KeyNamespace(model="mp")
def key(i): return ns.key(i.to_bytes(16, "little"))
def data(seed, n): return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
out = {}
if mode == "store":
    out["stored"] = [b.put(key(i), data(i, arg["n"])) for i in arg["keys"]]
elif mode == "remove":
    out["removed"] = [b.remove(key(i)) for i in arg["keys"]]
elif mode == "fight":
    mine = data(arg["seed"], arg["n"])
    others = [data(s, arg["n"]) for s in arg["seeds"]]
    wrong = hits = 0
    for _ in range(arg["rounds"]):
        b.remove(key(0))
        b.put(key(0), mine)
        got = torch.empty(arg["n"], dtype=torch.uint8)
        if b.get(key(0), got):
            hits += 1
            wrong += not any(torch.equal(got, o) for o in others)
    out.update(wrong=wrong, hits=hits)
print(json.dumps(out), flush=True)
"""


def key(i: int):
    return NS.key(i.to_bytes(16, "little"))


def data(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def spawn(root: Path, mode: str, arg: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), mode, json.dumps(arg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(p: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def open_disk(root: Path) -> DiskBackend:
    b = create_disk_backend({"path": str(root), "max_size": "1GiB"}, make_context())
    assert b.wait_for_scan(60)  # start-up indexes in the background
    return b


def test_one_process_stores_the_other_hits(tmp_path: Path) -> None:
    root = tmp_path / "t"
    mine = open_disk(root)  # opened first: its index knows nothing the child writes
    assert mine.stats().chunks == 0
    r = result(spawn(root, "store", {"keys": list(range(8)), "n": 100_000}))
    assert r["stored"] == [True] * 8
    keys = [key(i) for i in range(8)]
    assert mine.contains(keys) == 8
    for i, k in enumerate(keys):
        out = torch.empty(100_000, dtype=torch.uint8)
        assert mine.get(k, out) and torch.equal(out, data(i, 100_000))
    assert mine.stats().chunks == 8  # adopted into this process's index and budget
    assert mine.put(keys[0], data(0, 100_000))  # no-op: the other process already stored it


def test_removal_by_another_process_is_noticed(tmp_path: Path) -> None:
    root = tmp_path / "t"
    mine = open_disk(root)
    assert mine.put(key(1), data(1, 5000)) and mine.put(key(2), data(2, 5000))
    assert result(spawn(root, "remove", {"keys": [1]}))["removed"] == [True]
    assert mine.contains([key(1), key(2)]) == 0
    assert mine.contains([key(2)]) == 1
    assert mine.get(key(1), torch.empty(5000, dtype=torch.uint8)) is False
    assert mine.stats().chunks == 1


def test_concurrent_stores_of_one_key_from_processes(tmp_path: Path) -> None:
    """Two processes remove and re-store the same key with different data while
    this one reads it: every hit anywhere is exactly one writer's data."""
    root = tmp_path / "t"
    n = 1 << 20
    mine = open_disk(root)
    seeds = [101, 202]
    arg = {"n": n, "seeds": seeds, "rounds": 25}
    procs = [spawn(root, "fight", {**arg, "seed": s}) for s in seeds]
    expect = [data(s, n) for s in seeds]
    hits = wrong = 0
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        out = torch.empty(n, dtype=torch.uint8)
        if mine.get(key(0), out):
            hits += 1
            wrong += not any(torch.equal(out, e) for e in expect)
    results = [result(p) for p in procs]
    assert wrong == 0 and all(r["wrong"] == 0 for r in results), (wrong, results)
    assert sum(r["hits"] for r in results) > 0
    assert not list(root.glob("??/.tmp-*"))
    out = torch.empty(n, dtype=torch.uint8)
    if mine.get(key(0), out):
        assert any(torch.equal(out, e) for e in expect)
    assert mine.stats().extra["corrupt_removed"] == 0


def test_concurrent_stores_of_one_key_from_threads(tmp_path: Path) -> None:
    root = tmp_path / "t"
    backends = [open_disk(root) for _ in range(2)]  # two instances, like two processes
    n = 256 << 10
    expect = [data(s, n) for s in range(4)]
    wrong: list[int] = []

    def writer(i: int) -> None:
        b = backends[i % 2]
        for _ in range(30):
            b.remove(key(0))
            b.put(key(0), expect[i])
            out = torch.empty(n, dtype=torch.uint8)
            if b.get(key(0), out) and not any(torch.equal(out, e) for e in expect):
                wrong.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    final = open_disk(root)
    out = torch.empty(n, dtype=torch.uint8)
    assert final.get(key(0), out) and any(torch.equal(out, e) for e in expect)
    assert not list(root.glob("??/.tmp-*"))
