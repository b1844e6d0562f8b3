"""A real Mooncake Store on loopback for the mooncake tier's tests.

``MooncakeMaster`` runs the ``mooncake_master`` binary from the Python wheel with
its HTTP metadata server, on free ports of 127.0.0.1; ``SegmentOwner`` runs the
wheel's ``mooncake_client`` service, which contributes DRAM to the pool (the store
service a fleet runs next to the master). Both can be killed and restarted on the
same ports. When the wheel or its system libraries are missing, ``require_mooncake``
skips with what to install (CI installs them, see .ci/run).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

START_TIMEOUT_S = 20.0


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def require_mooncake() -> Path:
    """The wheel's directory, or skip saying what is missing."""
    pkg = _package_dir()
    if pkg is None or not (pkg / "mooncake_master").exists():
        pytest.skip("Mooncake client not installed: pip install mooncake-transfer-engine-non-cuda (see requirements-dev.txt)")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as err:
        pytest.skip(f"Mooncake client cannot load ({err}): apt-get install libibverbs1 librdmacm1 (as .ci/run does)")
    return pkg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: Any, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} not ready within {START_TIMEOUT_S}s: {log.read_text(errors='replace')[-2000:]}")


class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1 with its HTTP metadata server."""

    def __init__(self, workdir: Path, *, client_ttl_s: int = 3) -> None:
        self.pkg = require_mooncake()
        self.workdir = workdir
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.client_ttl_s = client_ttl_s
        self.master = f"127.0.0.1:{self.rpc_port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        log = self.workdir / "master.log"
        args = [
            str(self.pkg / "mooncake_master"),
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl_s}", "--rpc_thread_num=2", "--enable_metric_reporting=false",
        ]
        self.proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=self.workdir)

        def ready() -> bool:
            with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2):
                pass
            try:
                urllib.request.urlopen(f"{self.metadata}?key=probe", timeout=0.5)
            except urllib.error.HTTPError:
                pass  # 404 for an unknown key: the server answers
            return True

        _wait(ready, self.proc, "mooncake_master", log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def options(self, **options: Any) -> dict[str, Any]:
        """The mooncake factory's section for this master (a ``backends:`` entry less ``name``)."""
        return {"master": self.master, "metadata": self.metadata, "local_hostname": "127.0.0.1", **options}

    def section(self, **options: Any) -> dict[str, Any]:
        return {"name": "mooncake", **self.options(**options)}


class SegmentOwner:
    """The wheel's ``mooncake_client`` service: contributes ``size_mib`` of DRAM to the pool."""

    def __init__(self, master: MooncakeMaster, size_mib: int = 256) -> None:
        self.master = master
        self.size_mib = size_mib
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        log = self.master.workdir / f"owner-{self.port}.log"
        args = [
            str(self.master.pkg / "mooncake_client"),
            f"--master_server_address={self.master.master}", f"--metadata_server={self.master.metadata}",
            "--host=127.0.0.1", f"--port={self.port}", f"--global_segment_size={self.size_mib} MB",
            "--local_buffer_size=16 MB", "--protocol=tcp",
        ]
        self.proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=self.master.workdir)
        mounted = log.stat().st_size

        def ready() -> bool:
            text = log.read_bytes()[mounted:]
            return b"Starting real client service" in text

        _wait(ready, self.proc, "mooncake_client (segment owner)", log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master plus one 256 MiB segment owner for the session."""
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    owner = SegmentOwner(master)
    try:
        yield master
    finally:
        owner.kill()
        master.kill()


@pytest.fixture
def fresh_store(tmp_path: Path) -> Iterator[tuple[MooncakeMaster, SegmentOwner]]:
    """A master and segment owner of its own, for tests that kill them."""
    master = MooncakeMaster(tmp_path)
    owner = SegmentOwner(master, size_mib=64)
    try:
        yield master, owner
    finally:
        owner.kill()
        master.kill()


def quiet_glog() -> None:
    """Keep the native client's INFO lines out of test output."""
    os.environ.setdefault("GLOG_minloglevel", "1")
