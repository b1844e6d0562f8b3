"""The mooncake tier's tests talk over loopback only, as every test here must.

Mooncake's transfer engine advertises the host's main interface address to its peers
(and they connect to it) even when every component is told ``127.0.0.1``; measured:
31 connections to the host's ``eth0`` address during the conformance run; so the local
store helpers set ``MC_TCP_BIND_ADDRESS=127.0.0.1``. This test watches the
kernel's TCP table (``/proc/net/tcp``, ``tcp6``) while a tier stores and reads chunks
through a segment owner: no connection may reach a non-loopback address. Negative
control (in a child process): the same run with the engine pointed at the host's own
interface address is seen by the same watcher."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mooncake_server import MooncakeMaster, SegmentOwner  # noqa: E402

from lmcache_backend_mooncake import create_mooncake_backend  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

CHILD = "LMCACHE_TEST_MOONCAKE_BIND"
_STATES = {"01", "02", "03"}  # ESTABLISHED, SYN_SENT, SYN_RECV


def _remote(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host = hexaddr.split(":")[0]
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four little-endian words
    addr = ipaddress.IPv6Address(words)
    return addr.ipv4_mapped or addr


def non_loopback_connections() -> set[str]:
    """Open TCP connections (any process) whose remote end is not a loopback address."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] in _STATES:
                addr = _remote(fields[2])
                if not addr.is_loopback and not addr.is_unspecified:
                    found.add(f"{addr}:{int(fields[2].split(':')[1], 16)}")
    return found


def host_address() -> str | None:
    """This host's main interface address, or None on a loopback-only host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the route
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(addr).is_loopback else str(addr)


def run_and_watch(workdir: Path) -> set[str]:
    """A tier's puts and gets through a segment owner, with the TCP table watched."""
    before = non_loopback_connections()
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(non_loopback_connections() - before)
            stop.wait(0.02)

    master = MooncakeMaster(workdir)
    owner = SegmentOwner(master, size_mib=64)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        b = create_mooncake_backend(master.options(staging_size="16MiB"), make_context())
        try:
            for i in range(4):
                key, data = random_key(), random_chunk(seed=i)
                assert b.put(key, data)
                out = torch.empty_like(data)
                assert b.get(key, out) and torch.equal(out, data)
            time.sleep(0.2)
        finally:
            b.close()
    finally:
        stop.set()
        watcher.join(5)
        owner.kill()
        master.kill()
    return seen


def test_tier_and_store_connect_over_loopback_only(tmp_path: Path) -> None:
    seen = run_and_watch(tmp_path)
    assert not seen, f"connections to non-loopback addresses: {sorted(seen)}"


@pytest.mark.skipif(os.environ.get(CHILD) is not None, reason="the child runs the other case")
def test_negative_control_the_watcher_sees_the_host_address(tmp_path: Path) -> None:
    addr = host_address()
    if addr is None:
        pytest.skip("this host has no non-loopback address: nothing to tell apart")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_child_bound_to_host_address"],
        env={**os.environ, CHILD: addr, "MC_TCP_BIND_ADDRESS": addr},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(os.environ.get(CHILD) is None, reason="run in a child by the negative control")
def test_child_bound_to_host_address(tmp_path: Path) -> None:
    seen = run_and_watch(tmp_path)
    assert any(s.startswith(os.environ[CHILD] + ":") for s in seen), f"the watcher missed them: {sorted(seen)}"
