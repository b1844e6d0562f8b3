"""Disk tier behaviour on real files: config, restart, LRU across restarts,
crash leftovers, corruption, and write failures that must not stop serving."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_backend_disk import DiskBackend, create_disk_backend
from lmcache_backend_disk.directory import MARKER
from lmcache_core.config import ConfigError
from lmcache_core.serde import encode
from lmcache_core.testing import make_context, random_chunk, random_key

SHAPE = (4, 1024)  # 8 KiB of float16 per chunk


def open_disk(path: Path, **opts: object) -> DiskBackend:
    section = {"path": str(path), "max_size": "64MiB", **opts}
    b = create_disk_backend(section, make_context(key_path="backends[1]"))
    assert b.wait_for_scan(60)  # start-up indexes in the background: check what it leaves
    return b


def frame_size(key, data) -> int:
    return len(encode(key, data, make_context().codec))


def chunk_file(b: DiskBackend, key) -> Path:
    return b.directory.chunk_path(key)


def hit(b: DiskBackend, key, data: torch.Tensor) -> bool:
    out = torch.empty_like(data)
    return b.get(key, out) and torch.equal(out.view(torch.uint8), data.view(torch.uint8))


# -- config --------------------------------------------------------------------------------
def test_config_requires_path_and_names_key_path_and_source() -> None:
    with pytest.raises(ConfigError) as e:
        create_disk_backend({"max_size": "1GiB"}, make_context(key_path="backends[1]"))
    assert "backends[1].path" in str(e.value) and "(from test)" in str(e.value)


@pytest.mark.parametrize(
    "section,where",
    [
        ({"max_size": "lots"}, "backends[1].max_size"),
        ({"io_threads": 0}, "backends[1].io_threads"),
        ({"o_direct": "sometimes"}, "backends[1].o_direct"),
        ({"max_sise": "1GiB"}, "backends[1].max_sise: unknown key"),
    ],
)
def test_config_bad_values(tmp_path: Path, section: dict, where: str) -> None:
    with pytest.raises(ConfigError) as e:
        create_disk_backend({"path": str(tmp_path / "t"), **section}, make_context(key_path="backends[1]"))
    assert where in str(e.value)


def test_config_max_size_units(tmp_path: Path) -> None:
    b = open_disk(tmp_path / "t", max_size="3MiB")
    assert b.stats().bytes_capacity == 3 * 2**20


def test_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"backends\[1\]\.path: .* is not a directory"):
        open_disk(tmp_path / "f")


def test_non_empty_foreign_directory_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(ConfigError, match=r"backends\[1\]\.path: .* not empty and is not a disk tier"):
        open_disk(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "precious"
    assert not (tmp_path / MARKER).exists()


# -- restart and LRU -----------------------------------------------------------------------
def test_restart_hits_everything_stored_before(tmp_path: Path) -> None:
    items = [(random_key(), random_chunk(SHAPE, seed=i)) for i in range(20)]
    b = open_disk(tmp_path / "t")
    for k, d in items:
        assert b.put(k, d)
    b.close()
    b2 = open_disk(tmp_path / "t")
    s = b2.stats()
    assert s.chunks == 20 and s.bytes_used == sum(frame_size(k, d) for k, d in items)
    assert b2.contains([k for k, _ in items]) == 20
    assert all(hit(b2, k, d) for k, d in items)


def test_byte_budget_evicts_lru(tmp_path: Path) -> None:
    d0 = random_chunk(SHAPE, seed=0)
    fsize = frame_size(random_key(), d0)
    b = open_disk(tmp_path / "t", max_size=fsize * 5)
    keys = [random_key() for _ in range(12)]
    for i, k in enumerate(keys):
        assert b.put(k, random_chunk(SHAPE, seed=i))
        assert b.stats().bytes_used <= fsize * 5
    s = b.stats()
    assert s.chunks == 5 and s.evictions == 7
    assert [b.contains([k]) for k in keys] == [0] * 7 + [1] * 5
    on_disk = sum(p.stat().st_size for p in (tmp_path / "t").glob("??/v1-*"))
    assert on_disk == s.bytes_used


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "tinylfu"])
def test_eviction_takes_the_cpu_tiers_policies(tmp_path: Path, policy: str) -> None:
    """``eviction:`` picks the same policies as the CPU tier: a hot set read between
    every put of a one-off scan survives with s3fifo and tinylfu, while LRU (the
    default, the control) lets the scan flush it; the budget holds for every policy."""
    fsize = frame_size(random_key(), random_chunk(SHAPE, seed=0))
    b = open_disk(tmp_path / "t", max_size=fsize * 10, eviction=policy)
    hot = [random_key() for _ in range(4)]
    data = {k: random_chunk(SHAPE, seed=i) for i, k in enumerate(hot)}
    for k in hot:
        assert b.put(k, data[k])
    for _ in range(3):
        assert all(hit(b, k, data[k]) for k in hot)
    for i in range(40):  # a scan of one-off chunks, 4x the tier, the hot set read at times
        assert b.put(random_key(), random_chunk(SHAPE, seed=100 + i))
        assert b.stats().bytes_used <= fsize * 10
        if i % 12 == 11:
            for k in hot:
                hit(b, k, data[k])
    kept = sum(b.contains([k]) for k in hot)
    if policy == "lru":
        assert kept < 4
    else:
        assert kept == 4, f"{policy} let a scan flush the hot set"
    assert b.stats().bytes_used == sum(p.stat().st_size for p in (tmp_path / "t").glob("??/v1-*"))


def test_an_unknown_eviction_policy_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"backends\[1\]\.eviction"):
        open_disk(tmp_path / "t", eviction="mru")


def test_evictions_are_reported_to_the_engine_listener(tmp_path: Path) -> None:
    """Each chunk dropped for room is reported once (KV events), in LRU order; a
    remove() is not an eviction."""
    fsize = frame_size(random_key(), random_chunk(SHAPE, seed=0))
    b = open_disk(tmp_path / "t", max_size=fsize * 3)
    seen: list = []
    b.subscribe_evictions(seen.append)
    keys = [random_key() for _ in range(6)]
    for i, k in enumerate(keys):
        assert b.put(k, random_chunk(SHAPE, seed=i))
    assert seen == keys[:3]
    assert b.remove(keys[5]) and seen == keys[:3]


def test_chunk_larger_than_budget_is_skipped(tmp_path: Path) -> None:
    b = open_disk(tmp_path / "t", max_size=4096)
    assert b.put(random_key(), random_chunk(SHAPE)) is False
    assert b.stats().skipped == 1


def test_lru_order_survives_restart(tmp_path: Path) -> None:
    data = [random_chunk(SHAPE, seed=i) for i in range(4)]
    keys = [random_key() for _ in range(4)]
    fsize = frame_size(keys[0], data[0])
    b = open_disk(tmp_path / "t", max_size=fsize * 3)
    for k, d in zip(keys[:3], data):
        assert b.put(k, d)
        time.sleep(0.05)  # distinct mtimes even on coarse filesystem clocks
    assert hit(b, keys[0], data[0])  # keys[0] becomes most recently used
    b.close()
    b2 = open_disk(tmp_path / "t", max_size=fsize * 3)
    assert b2.put(keys[3], data[3])
    assert [b2.contains([k]) for k in keys] == [1, 0, 1, 1]


def test_restart_with_smaller_budget_trims_oldest(tmp_path: Path) -> None:
    keys = [random_key() for _ in range(6)]
    b = open_disk(tmp_path / "t")
    for i, k in enumerate(keys):
        b.put(k, random_chunk(SHAPE, seed=i))
        time.sleep(0.02)
    fsize = b.stats().bytes_used // 6
    b2 = open_disk(tmp_path / "t", max_size=fsize * 2)
    assert [b2.contains([k]) for k in keys] == [0, 0, 0, 0, 1, 1]
    assert len(list((tmp_path / "t").glob("??/v1-*"))) == 2


# -- crash safety --------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


_HOLDER = r"""
import sys
from lmcache_backend_disk import create_disk_backend
from lmcache_core.testing import make_context
b = create_disk_backend({"path": sys.argv[1], "max_size": "64MiB"}, make_context())
b.wait_for_scan(60)
print("open", flush=True)
sys.stdin.read()
b.close()
"""


def test_leftover_temp_and_truncated_files_are_never_loaded_and_cleaned(tmp_path: Path) -> None:
    b = open_disk(tmp_path / "t")
    good_k, good = random_key(), random_chunk(SHAPE, seed=1)
    trunc_k, trunc = random_key(), random_chunk(SHAPE, seed=2)
    assert b.put(good_k, good) and b.put(trunc_k, trunc)
    b.close()
    # a writer that is still running (a live process that has the tier open: it holds
    # its pid's byte of the owner file, see owners.py); started first, as its own
    # start-up scan would clean what is planted below
    writer = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "t")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "open"
        frame = encode(trunc_k, trunc, make_context().codec)
        chunk_file(b, trunc_k).write_bytes(frame[: len(frame) // 2])
        # a temp file a killed writer left behind: a complete frame, but never renamed
        tmp_k = random_key()
        leftover = b.directory.shard(tmp_k) / f".tmp-{_dead_pid()}-0123456789abcdef"
        leftover.write_bytes(encode(tmp_k, good, make_context().codec))
        # the running writer's temp file must survive
        live = b.directory.shard(tmp_k) / f".tmp-{writer.pid}-fedcba9876543210-11"
        live.write_bytes(b"in progress")
        b2 = open_disk(tmp_path / "t")
    finally:
        writer.communicate("", timeout=60)
    s = b2.stats()
    assert s.extra["startup_stale_temps"] == 1 and s.extra["startup_bad_removed"] == 1
    assert not leftover.exists() and live.exists()
    assert not chunk_file(b2, trunc_k).exists()
    assert s.chunks == 1
    assert b2.contains([trunc_k]) == 0 and b2.contains([tmp_k]) == 0
    assert hit(b2, good_k, good)


def test_truncated_file_is_a_miss_on_get_without_restart(tmp_path: Path) -> None:
    b = open_disk(tmp_path / "t")
    k, d = random_key(), random_chunk(SHAPE)
    b.put(k, d)
    p = chunk_file(b, k)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 1)
    out = torch.zeros_like(d)
    assert b.get(k, out) is False
    assert not p.exists() and b.stats().extra["corrupt_removed"] == 1
    assert b.contains([k]) == 0


_KILL_CHILD = r"""
import sys, torch
from lmcache_backend_disk import create_disk_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context
b = create_disk_backend({"path": sys.argv[1], "max_size": "1GiB"}, make_context())
ns = KeyNamespace(model="crash")
i = 0
while i < 100000:
    g = torch.Generator().manual_seed(i)
    b.put(ns.key(i.to_bytes(16, "little")), torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=g))
    print(i, flush=True)
    i += 1
"""


def test_writer_killed_mid_write_leaves_only_complete_chunks(tmp_path: Path) -> None:
    """A real crash: SIGKILL a process that is writing 4 MiB chunks."""
    from lmcache_core.keys import KeyNamespace

    root = tmp_path / "t"
    open_disk(root).close()
    p = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        lines = 0
        deadline = time.monotonic() + 60
        while lines < 3 and time.monotonic() < deadline:
            if p.stdout.readline() == "":
                break
            lines += 1
        assert lines == 3, "child did not start writing"
        time.sleep(0.01)
    finally:
        p.kill()
        p.wait(timeout=30)
    b = open_disk(root, max_size="1GiB")
    assert not list(root.glob("??/.tmp-*"))
    ns = KeyNamespace(model="crash")
    n = b.stats().chunks
    assert n >= 3
    for i in range(n + 2):
        k = ns.key(i.to_bytes(16, "little"))
        expect = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        if b.contains([k]):
            assert hit(b, k, expect)


# -- corruption ----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.floats(0, 1, exclude_max=True), xor=st.integers(1, 255))
def test_flipped_byte_is_a_miss_and_removed(tmp_path_factory: pytest.TempPathFactory, pos: float, xor: int) -> None:
    b = open_disk(tmp_path_factory.mktemp("flip") / "t")
    k, d = random_key(), random_chunk((2, 64))
    assert b.put(k, d)
    p = chunk_file(b, k)
    raw = bytearray(p.read_bytes())
    raw[int(pos * len(raw))] ^= xor
    p.write_bytes(bytes(raw))
    out = torch.empty_like(d)
    assert b.get(k, out) is False
    assert not p.exists()
    assert b.stats().extra["corrupt_removed"] == 1


def test_frame_of_another_key_is_a_miss_and_removed(tmp_path: Path) -> None:
    b = open_disk(tmp_path / "t")
    a, victim = random_key(), random_key()
    d = random_chunk(SHAPE)
    b.put(a, d)
    shutil.copy(chunk_file(b, a), chunk_file(b, victim))
    assert b.contains([victim]) == 1  # a name only; the content is checked on read
    assert b.get(victim, torch.empty_like(d)) is False
    assert not chunk_file(b, victim).exists() and hit(b, a, d)


def test_bad_chunk_files_are_removed_and_foreign_files_kept_at_startup(tmp_path: Path) -> None:
    """Files under chunk names that are not valid frames are removed; a file the
    tier did not name (``notes.txt``) is never deleted: the directory may hold files
    that are not the tier's."""
    b = open_disk(tmp_path / "t")
    k, d = random_key(), random_chunk(SHAPE)
    b.put(k, d)
    b.close()
    shard = b.directory.shard(k)
    stranger = shard / "notes.txt"
    stranger.write_text("hello")
    copied = chunk_file(b, random_key())
    shutil.copy(chunk_file(b, k), copied)  # a valid frame under another key's name
    garbage = chunk_file(b, random_key())
    garbage.write_bytes(os.urandom(5000))
    b2 = open_disk(tmp_path / "t")
    s = b2.stats()
    assert s.extra["startup_foreign_kept"] == 1 and s.extra["startup_bad_removed"] == 2
    assert stranger.read_text() == "hello" and not copied.exists() and not garbage.exists()
    assert s.chunks == 1 and hit(b2, k, d)


def test_wrong_shape_request_is_a_miss_but_keeps_the_file(tmp_path: Path) -> None:
    b = open_disk(tmp_path / "t")
    k, d = random_key(), random_chunk(SHAPE)
    b.put(k, d)
    assert b.get(k, torch.empty(2, 1024, dtype=torch.float16)) is False
    assert chunk_file(b, k).exists() and hit(b, k, d)
    assert b.stats().extra["shape_mismatch"] == 1


# -- write failures ------------------------------------------------------------------------
def test_parent_is_a_regular_file_put_fails_serving_goes_on(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    b = open_disk(tmp_path / "file" / "tier")
    assert "cannot write" in b.stats().extra["unavailable"]
    k, d = random_key(), random_chunk(SHAPE)
    assert b.put(k, d) is False
    assert b.get(k, torch.empty_like(d)) is False
    assert b.contains([k]) == 0
    s = b.stats()
    assert s.errors == 1 and s.extra["write_errors"] == 1 and s.puts == 0


_RO_CHILD = r"""
import json, sys, torch
from lmcache_backend_disk import create_disk_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context
b = create_disk_backend({"path": sys.argv[1], "max_size": "1GiB"}, make_context())
ns = KeyNamespace(model="ro")
old = torch.arange(4096, dtype=torch.float32)
out = torch.empty_like(old)
hit = b.get(ns.key(b"\x01" * 16), out) and torch.equal(out, old)
put = b.put(ns.key(b"\x02" * 16), old)
hit2 = b.get(ns.key(b"\x01" * 16), out) and torch.equal(out, old)
s = b.stats()
print(json.dumps({"hit": hit, "put": put, "hit2": hit2, "errors": s.errors, "skipped": s.skipped}))
"""


def _prefill_for_ro(root: Path) -> None:
    from lmcache_core.keys import KeyNamespace

    b = open_disk(root)
    assert b.put(KeyNamespace(model="ro").key(b"\x01" * 16), torch.arange(4096, dtype=torch.float32))
    b.close()


def _check_ro_result(stdout: str) -> None:
    import json

    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["hit"] and r["hit2"], r
    assert r["put"] is False, r
    assert r["errors"] + r["skipped"] >= 1, r


def _ro_checks(root: Path) -> dict:
    """The read-only checks of _RO_CHILD, in this process (for a forked child)."""
    from lmcache_core.keys import KeyNamespace

    b = open_disk(root, max_size="1GiB")
    ns = KeyNamespace(model="ro")
    old = torch.arange(4096, dtype=torch.float32)
    out = torch.empty_like(old)
    hit1 = b.get(ns.key(b"\x01" * 16), out) and torch.equal(out, old)
    put = b.put(ns.key(b"\x02" * 16), old)
    hit2 = b.get(ns.key(b"\x01" * 16), out) and torch.equal(out, old)
    s = b.stats()
    return {"hit": hit1, "put": put, "hit2": hit2, "errors": s.errors, "skipped": s.skipped}


def _run_as_nobody(fn, *args) -> str:
    """Fork, drop to uid/gid 65534 in the child, run ``fn``; its JSON result.
    (The interpreter lives under a root-only directory, so exec as nobody fails:
    everything the child needs is imported before the fork.)"""
    import json

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(wfd, json.dumps(fn(*args)).encode())
            code = 0
        except BaseException as err:  # noqa: BLE001 - reported through the pipe
            os.write(wfd, json.dumps({"child_error": repr(err)}).encode())
        finally:
            os._exit(code)
    os.close(wfd)
    deadline = time.monotonic() + 120
    chunks = []
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("read-only child timed out")
        while True:
            part = os.read(rfd, 65536)
            if not part:
                break
            chunks.append(part)
    finally:
        os.close(rfd)
    return b"".join(chunks).decode()


def test_read_only_directory_put_fails_reads_go_on(tmp_path: Path) -> None:
    """chmod'ed directory. Root ignores permissions, so as root the checks run in a
    forked child that drops to uid/gid 65534 (nobody)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="lmcache-ro-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        root = base / "t"
        _prefill_for_ro(root)
        for d in [root, *root.iterdir()]:
            if d.is_dir():
                os.chmod(d, 0o555)
        if os.geteuid() == 0:
            out = _run_as_nobody(_ro_checks, root)
        else:
            import json

            out = json.dumps(_ro_checks(root))
        assert "child_error" not in out, out
        _check_ro_result(out)
    finally:
        for d in base.rglob("*"):
            if d.is_dir():
                os.chmod(d, 0o755)
        shutil.rmtree(base, ignore_errors=True)


def _in_private_mount_ns(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a shell script in a private mount namespace (its mounts vanish with it)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed: cannot mount a small filesystem")
    args = ["unshare", "-m", "sh", "-ec", script] if os.geteuid() == 0 else ["unshare", "-rm", "sh", "-ec", script]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if r.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN / user namespaces): {r.stderr.strip()[-300:]}")
    return r


def test_read_only_filesystem_put_fails_reads_go_on(tmp_path: Path) -> None:
    """A real read-only mount (works as root): tmpfs, filled, remounted ro."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    root = mnt / "t"
    prefill = (
        "import sys; sys.path[:0]=[]; from pathlib import Path; "
        "import test_disk_backend as t; t._prefill_for_ro(Path(sys.argv[1]))"
    )
    script = f"""
mount -t tmpfs -o size=8m tmpfs {mnt} || exit 97
cd {Path(__file__).parent}
{sys.executable} -c '{prefill}' {root}
mount -o remount,ro {mnt}
{sys.executable} -c '{_RO_CHILD}' {root}
"""
    r = _in_private_mount_ns(script)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_ro_result(r.stdout)


_FULL_CHILD = r"""
import json, sys, torch
from lmcache_backend_disk import create_disk_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.testing import make_context
b = create_disk_backend({"path": sys.argv[1], "max_size": "1GiB"}, make_context())
ns = KeyNamespace(model="full")
data = [torch.full((64 << 10,), i, dtype=torch.float32) for i in range(40)]  # 256 KiB each
stored = [b.put(ns.key(i.to_bytes(16, "little")), d) for i, d in enumerate(data)]
hits = []
for i, d in enumerate(data):
    out = torch.empty_like(d)
    hits.append(bool(b.get(ns.key(i.to_bytes(16, "little")), out) and torch.equal(out, d)))
s = b.stats()
import os
left = [n for n in os.listdir(sys.argv[1] + "/" + ns.key((0).to_bytes(16, "little")).chunk_hash[:1].hex()) if n.startswith(".tmp")]
print(json.dumps({"stored": stored, "hits": hits, "skipped": s.skipped, "disk_full": s.extra["disk_full"],
                  "puts": s.puts, "temps": left}))
"""


def test_disk_full_put_returns_false_and_serving_goes_on(tmp_path: Path) -> None:
    """ENOSPC from a real 4 MiB tmpfs (the byte budget is far larger)."""
    import json

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f"""
mount -t tmpfs -o size=4m tmpfs {mnt} || exit 97
{sys.executable} -c '{_FULL_CHILD}' {mnt / "t"}
"""
    r = _in_private_mount_ns(script)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    n_ok = sum(res["stored"])
    assert 3 <= n_ok < 40, res
    assert res["stored"] == [True] * n_ok + [False] * (40 - n_ok), res
    assert res["skipped"] == 40 - n_ok == res["disk_full"] and res["puts"] == n_ok
    assert res["hits"] == res["stored"]
    assert res["temps"] == []


# -- O_DIRECT ------------------------------------------------------------------------------
def test_o_direct_roundtrip_or_clean_fallback(tmp_path: Path) -> None:
    b = open_disk(tmp_path / "t", o_direct=True)
    s = b.stats()
    assert s.extra["o_direct"] is True or s.extra["o_direct_fallback"]
    items = [(random_key(), random_chunk((3, 1000 + i), seed=i)) for i in range(5)]  # sizes not 4 KiB multiples
    for k, d in items:
        assert b.put(k, d)
    for k, d in items:
        assert chunk_file(b, k).stat().st_size == frame_size(k, d)
        assert hit(b, k, d)
    b.close()
    b2 = open_disk(tmp_path / "t")  # buffered reader of O_DIRECT-written files
    assert all(hit(b2, k, d) for k, d in items)
