"""Hardening round 3, item 1: can a second local user make root load their library
as the fp8 kernel by swapping the cache directory? Run as root:

    python bench/security/fp8_load_race.py [--seconds 60]

A parent directory that another user (uid 65534) can write holds root's cache
directory (``LMCACHE_CACHE_DIR``). That user's process swaps it, in a tight loop, for
a directory of their own holding a library under the kernel's name whose constructor
leaves a mark. Two arms, each for ``--seconds``:

- ``product``: fresh processes start an engine with an fp8 tier (and encode and
  decode through it) with that cache directory; counted: starts, marks (foreign code
  run as root), processes that mapped any file under the parent, and whether each
  ran the package's own compiled kernel;
- ``control``: the pre-round-3 loader's steps (check the directory and the file by
  path, then ``dlopen`` by path), each try in a forked child: shows the harness
  catches a foreign load when the loader is racy.

The product arm must show 0 foreign loads and 0 foreign mappings; the control arm
shows the race is live on this machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOBODY = 65534
NAME = "fp8_kernel-0000000000000000.so"
PROBE = """
import json, torch
from lmcache_core import fp8_native
from lmcache_core.config import load_config
from lmcache_core.engine import CacheEngine
from lmcache_core.fp8 import Fp8Codec
from lmcache_core.keys import KeyNamespace
from lmcache_core.plugins import PluginManager
backends = [{"name": "local_cpu", "max_size": "16MiB"}, {"name": "example_dict", "max_entries": 10, "serde": "fp8"}]
cfg = load_config(env={}, overrides={"chunk_size": 16, "backends": backends})
with CacheEngine(cfg, namespace=KeyNamespace(model="race"), plugins=PluginManager()):
    k = fp8_native.kernel()
    x = torch.randn(4096).to(torch.bfloat16)
    c = Fp8Codec()
    c.decode_tensor(c.encode_tensor(x), torch.bfloat16, (4096,), None)
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if l.rstrip().endswith(".so")})
print(json.dumps({"variant": k and k.variant, "maps": maps}))
"""


def _evil_library(where: Path, marker: Path) -> Path:
    src = where / "evil.c"
    src.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void mark(void) {{ FILE *f = fopen("{marker}", "a"); '
        'if (f) { fputs("x", f); fclose(f); } }\n'
    )
    lib = where / "evil.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _attacker(parent: Path, lib: Path) -> int:
    """Fork a process as uid 65534 that swaps parent/cache with its own directory."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        own = parent / "evil"
        own.mkdir()
        shutil.copy(lib, own / NAME)
        (own / NAME).chmod(0o755)
        while True:
            try:
                os.rename(parent / "cache", parent / "real")
                os.rename(own, parent / "cache")
                os.rename(parent / "cache", own)
                os.rename(parent / "real", parent / "cache")
            except OSError:
                time.sleep(0.0001)
    finally:
        os._exit(0)


def _old_loader_try(cache: Path) -> None:
    """The pre-round-3 steps, in a child: path checks, then dlopen by path."""
    pid = os.fork()
    if pid == 0:
        try:
            for p in (cache, cache / NAME):
                st = p.stat()
                if st.st_uid != os.getuid() or st.st_mode & 0o022:
                    os._exit(1)
            ctypes.CDLL(str(cache / NAME))
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="10 s per arm")
    args = ap.parse_args(argv)
    seconds = 10.0 if args.quick else args.seconds
    if os.getuid() != 0:
        print("skipped: needs root (the victim) and a second uid (the attacker)")
        return 0
    work = Path(tempfile.mkdtemp(prefix="fp8-race-"))
    work.chmod(0o755)
    parent = work / "shared"
    parent.mkdir()
    parent.chmod(0o777)  # writable by the attacker, not sticky
    marker = work / "marks"
    lib = _evil_library(work, marker)
    lib.chmod(0o755)
    results = {}
    for arm in ("product", "control"):
        cache = parent / "cache"
        cache.mkdir(mode=0o700)
        if arm == "control":  # root's own library where the old loader expected it
            (work / "ok.c").write_text("int ok(void) { return 0; }\n")
            subprocess.run(
                [shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(cache / NAME), str(work / "ok.c")], check=True
            )
        marker.unlink(missing_ok=True)
        attacker = _attacker(parent, lib)
        tries = mapped = ours = 0
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < seconds:
                tries += 1
                if arm == "control":
                    _old_loader_try(cache)
                    continue
                env = dict(os.environ, LMCACHE_CACHE_DIR=str(cache), XDG_CACHE_HOME=str(cache), HOME=str(cache))
                out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                mapped += any(str(parent) in m for m in got["maps"])
                ours += got["variant"] is not None and any(Path(m).name.startswith("_fp8.") for m in got["maps"])
        finally:
            os.kill(attacker, signal.SIGKILL)
            os.waitpid(attacker, 0)
        foreign = len(marker.read_text()) if marker.exists() else 0
        results[arm] = {"tries": tries, "foreign_loads": foreign, "foreign_mappings": mapped, "package_kernel": ours}
        for d in ("cache", "real", "evil"):
            shutil.rmtree(parent / d, ignore_errors=True)
        print(
            f"{arm:8s} {seconds:.0f} s: {tries} tries, {foreign} foreign loads, {mapped} foreign mappings"
            + (f", {ours} ran the package's kernel" if arm == "product" else ""),
            flush=True,
        )
    shutil.rmtree(work, ignore_errors=True)
    ok = results["product"]["foreign_loads"] == 0 and results["product"]["foreign_mappings"] == 0
    ok = ok and results["product"]["package_kernel"] == results["product"]["tries"]
    print(json.dumps(results))
    print("PASS: 0 foreign loads in the product" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
