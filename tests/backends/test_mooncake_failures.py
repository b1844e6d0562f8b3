"""Failure behaviour of the mooncake tier against a real Mooncake Store on loopback:
the master killed mid-run and restarted, a segment owner killed, a master that is
not there at startup, a store out of space, and corrupt or foreign objects. Every
case is a miss (or a skipped put) within a bound derived from ``timeout_s``, never
an exception out of the tier and never wrong data."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mooncake_server import MooncakeMaster, SegmentOwner, fresh_store, mooncake_store  # noqa: E402,F401 - fixtures

from lmcache_backend_mooncake import create_mooncake_backend  # noqa: E402
from lmcache_backend_mooncake.backend import MooncakeBackend  # noqa: E402
from lmcache_core.backend import BackendError  # noqa: E402
from lmcache_core.serde import RawCodec, encode  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

TIMEOUT_S = 0.8
FAST = {"timeout_s": TIMEOUT_S, "down_cooldown_s": 0.5, "setup_timeout_s": 5.0, "staging_size": "16MiB"}
# One call: its deadline plus thread hand-off, with slack for 2 CPUs shared with other
# test runs (single wake-ups were seen to take 100-300 ms there). The native client
# itself takes 4+ s on a dead or hung master, so the bound still tells them apart.
BOUND_S = TIMEOUT_S + 1.2
# A call the health gate answers without touching the client.
INSTANT_S = 0.5


def make(store: MooncakeMaster, **options: Any) -> MooncakeBackend:
    backend = create_mooncake_backend(store.options(**{**FAST, **options}), make_context())
    assert isinstance(backend, MooncakeBackend)
    return backend


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - t0


def until(cond: Callable[[], bool], limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_master_killed_mid_run_then_restarted(fresh_store: tuple[MooncakeMaster, SegmentOwner]) -> None:
    master, _owner = fresh_store
    b = make(master)
    try:
        key, data = random_key(), random_chunk()
        assert b.put(key, data)
        assert b.contains([key]) == 1

        master.kill()
        out = torch.empty_like(data)
        for op in (lambda: b.get(key, out), lambda: b.put(random_key(), data), lambda: b.contains([key])):
            result, took = timed(op)
            assert result in (False, 0) and took < BOUND_S, (result, took)
        s = b.stats()
        assert s.extra["master_down"] is True and s.extra["master_trips"] == 1
        # Gate closed: calls are misses without touching the client.
        client = b._client
        assert client is not None
        reached: list[int] = []
        real_get_into = client.get_into
        client.get_into = lambda *a: (reached.append(1), real_get_into(*a))[1]  # type: ignore[method-assign]
        (hit, took) = timed(b.get, key, out)
        assert hit is False and took < INSTANT_S and reached == []

        # A hung master (its port accepts, nothing answers): the client would wait on
        # its own RPC timeouts; every call of the tier still returns by its deadline.
        with socket.socket() as hung:
            hung.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hung.bind(("127.0.0.1", master.rpc_port))
            hung.listen(64)
            for _ in range(2):
                time.sleep(0.6)  # past the cooldown: the next call is a probe that reaches the client
                result, took = timed(b.get, key, out)
                assert result is False and took < BOUND_S, took
        assert b.stats().extra["overruns"] >= 1

        master.start()  # same ports, empty metadata: the store's objects are gone
        fresh, fresh_data = random_key(), random_chunk(seed=7)
        assert until(lambda: b.put(fresh, fresh_data), 30), "no recovery within 30 s of the master's return"
        got = torch.empty_like(fresh_data)
        assert b.contains([fresh]) == 1 and b.get(fresh, got) and torch.equal(got, fresh_data)
        assert b.stats().extra["master_down"] is False
        assert b.contains([key]) == 0  # the restarted master does not know the old object
    finally:
        b.close()


def test_segment_owner_down_is_a_bounded_miss(fresh_store: tuple[MooncakeMaster, SegmentOwner]) -> None:
    master, owner = fresh_store
    b = make(master)
    try:
        key, data = random_key(), random_chunk()
        assert b.put(key, data)  # lands in the owner's segment (the tier contributes none)
        owner.kill()
        out = torch.zeros_like(data)
        for _ in range(3):
            hit, took = timed(b.get, key, out)
            assert hit is False and took < BOUND_S, took
        assert not torch.equal(out, data)
        assert b.stats().hits == 0
    finally:
        b.close()


ISOLATED = "LMCACHE_TEST_MOONCAKE_ISOLATED"


# What the native client prints when its setup waited on a master that had not
# answered yet (see test_master_absent_at_startup). "does not support overlapped memory
# region" is not among them: its cause was ours (the pool region, see below).
NATIVE_FAULTS = ("RPC call timed out", "Failed to create client on port")


def _run_isolated(case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # --capture=sys: the native client's log (written to fd 2) comes back in
        # stderr, where the retry below looks for its message, while the child's own
        # report (stdout) keeps its assertion in view.
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--capture=sys",
            "--show-capture=no",
            f"{__file__}::{case}",
        ],
        env={**os.environ, ISOLATED: "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_master_absent_at_startup() -> None:
    """Runs the case below in a fresh interpreter (the native client keeps
    per-process state). This case failed in CI with every reconnect refused by
    "Transfer Engine does not support overlapped memory region". The cause was the
    tier: it registered the pool of the context it was built with but did not hold
    that pool, so here (a context made for the call) the pool was freed, and the new
    client's own 64 MiB buffer could be allocated where the 64 MiB pool had been,
    overlapping the region the tier registered next. The tier now holds the pool
    (test_the_tier_keeps_the_pool_it_registered_alive), so that message fails this
    test at once. A setup that waited on a master still starting shows one of
    NATIVE_FAULTS (the native setup then holds the GIL for 30 s per try; the tier asks
    the master for an answer first): such a run is run once more in another fresh
    interpreter; any other failure fails the test at once."""
    proc = _run_isolated("test_master_absent_at_startup_case")
    seen = [m for m in NATIVE_FAULTS if m in proc.stderr]
    if proc.returncode != 0 and seen:
        print(f"first run failed with the native client's {seen}; running once more")
        proc = _run_isolated("test_master_absent_at_startup_case")
    native = "\n".join(line for line in proc.stderr.splitlines() if line[:1] in ("E", "W"))
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-6000:] + "\nnative errors:\n" + native[-3000:]


@pytest.mark.skipif(os.environ.get(ISOLATED) != "1", reason="run in its own interpreter by test_master_absent_at_startup")
def test_master_absent_at_startup_case(tmp_path: Path) -> None:
    master = MooncakeMaster(tmp_path)
    master.kill()
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"backends\[0\].*cannot connect to master 127\.0\.0\.1:\d+.*verify_on_start"):
        make(master)
    assert time.monotonic() - t0 < FAST["setup_timeout_s"] + 1.5

    b = make(master, verify_on_start=False)  # starts down, keeps connecting in the background
    try:
        key, data = random_key(), random_chunk()
        (ok, took) = timed(b.put, key, data)
        assert ok is False and took < INSTANT_S and b.stats().skipped == 1
        master.start()
        owner = SegmentOwner(master, size_mib=32)
        try:
            assert until(lambda: b.put(key, data), 30), "the tier did not connect after the master started"
            out = torch.empty_like(data)
            assert b.get(key, out) and torch.equal(out, data)
        finally:
            owner.kill()
    finally:
        b.close()
        master.kill()


def test_master_that_does_not_answer_is_not_set_up(fresh_store: tuple[MooncakeMaster, SegmentOwner]) -> None:
    """A stopped master still has its ports accept connections (the kernel does
    that). The native setup would then wait 30 s per try, up to 20 tries, holding the
    GIL: the whole process stops. The tier's probe asks the master's metadata server
    for an answer first, so connecting fails within its probe time instead, and works
    once the master runs again."""
    master, _owner = fresh_store
    assert master.proc is not None
    os.kill(master.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(BackendError, match=r"did not answer a GET within"):
            make(master)
        assert time.monotonic() - t0 < FAST["setup_timeout_s"] + 1.5
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    b = make(master)
    try:
        key, data = random_key(), random_chunk()
        # the master may take a moment to serve its segment owner again after a stop
        assert until(lambda: b.put(key, data), 30)
        out = torch.empty_like(data)
        assert b.get(key, out) and torch.equal(out, data)
    finally:
        b.close()


def test_put_rejected_for_space_is_a_counted_skip(fresh_store: tuple[MooncakeMaster, SegmentOwner]) -> None:
    master, _owner = fresh_store  # a 64 MiB segment
    b = make(master, staging_size="4MiB", timeout_s=5.0)
    try:
        big = torch.zeros(24 << 20, dtype=torch.uint8)  # three of these cannot fit in 64 MiB at once
        results = b.put_batch([(random_key(), big) for _ in range(4)])
        s = b.stats()
        assert results.count(False) >= 1 and s.extra["no_space"] >= 1, (results, s)
        assert s.skipped >= s.extra["no_space"] and s.puts == results.count(True)
        small, out = random_chunk(shape=(8, 8)), torch.empty(8, 8, dtype=torch.float16)
        k = random_key()
        assert b.put(k, small) and b.get(k, out)  # the tier goes on working
    finally:
        b.close()


def _raw_store(master: MooncakeMaster) -> Any:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", master.master) == 0
    return s


def test_corrupt_foreign_and_oversized_objects_are_misses(mooncake_store: MooncakeMaster) -> None:
    b = make(mooncake_store, key_prefix="corrupt/")
    raw = _raw_store(mooncake_store)
    try:
        data = random_chunk()
        cases: dict[str, bytes] = {}
        k_ok, k_flip, k_foreign, k_trunc, k_big, k_junk = (random_key() for _ in range(6))
        good = encode(k_ok, data, RawCodec())
        cases["intact"] = good  # negative control: written the same way, must hit
        flipped = bytearray(encode(k_flip, data, RawCodec()))
        flipped[-100] ^= 0x01
        cases["flipped"] = bytes(flipped)
        cases["foreign"] = encode(random_key(), data, RawCodec())  # a valid frame of another key
        cases["truncated"] = encode(k_trunc, data, RawCodec())[:-10]
        cases["oversized"] = encode(k_big, torch.zeros(4 * data.numel(), dtype=data.dtype), RawCodec())
        cases["junk"] = np.random.default_rng(1).bytes(len(good))
        keys = dict(zip(cases, (k_ok, k_flip, k_foreign, k_trunc, k_big, k_junk)))
        for name, blob in cases.items():
            assert raw.put(b._name(keys[name]), blob) == 0, name
        for name, key in keys.items():
            out = torch.zeros_like(data)
            hit, took = timed(b.get, key, out)
            assert took < BOUND_S
            if name == "intact":
                assert hit and torch.equal(out, data)
            else:
                assert hit is False, name
        s = b.stats()
        assert s.hits == 1 and s.misses == 5 and s.extra["corrupt"] >= 4
        assert s.extra["staging_used"] == 0  # every staging slot came back
    finally:
        raw.close()
        b.close()
