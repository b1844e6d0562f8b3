"""A Mooncake Store on this machine, from the binaries in the client wheel: for
development, tests and benchmarks (production runs the master and store services
under its own supervision).

``LocalMaster`` runs ``mooncake_master`` with its HTTP metadata server on free ports
of 127.0.0.1 (``LocalTenantMaster``: in multi-tenant mode, under a tenant quota policy); ``LocalSegmentOwner`` runs ``mooncake_client``, a store service that
contributes DRAM to the pool. Both can be killed and started again on the same
ports. Every wait is bounded.

Everything talks over loopback: the transfer engine otherwise advertises (and its
peers connect to) the host's main interface address even when told ``127.0.0.1``,
so the binaries, and clients created in this process after a :class:`LocalMaster`,
get ``MC_TCP_BIND_ADDRESS=127.0.0.1`` unless it is set already.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from .client import answers_http, reachable

START_TIMEOUT_S = 20.0
RESTART_TRIES = 6
#: the transfer engine's address for connections between clients and segment owners
LOOPBACK_ENV = "MC_TCP_BIND_ADDRESS"


def wheel_dir() -> Path:
    """The installed client wheel's directory (it holds the binaries)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Mooncake client is not installed: pip install mooncake-transfer-engine-non-cuda")
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / "mooncake_master").exists():
        raise RuntimeError(f"{path} has no mooncake_master binary; reinstall mooncake-transfer-engine-non-cuda")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
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
    proc.wait(timeout=10)
    raise RuntimeError(f"{what} not ready within {START_TIMEOUT_S}s: {log.read_text(errors='replace')[-2000:]}")


def _LOGGING_ENV() -> dict[str, str]:
    """The environment for the binaries: readiness is read from their INFO log lines,
    so a GLOG_minloglevel meant to quiet the client in this process must not reach them."""
    env = dict(os.environ)
    env["GLOG_minloglevel"] = "0"
    env.setdefault(LOOPBACK_ENV, "127.0.0.1")
    return env


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def tenant_policy(quotas: Mapping[str, int]) -> str:
    """The master's tenant quota policy file (``--tenant_quota_connector_type=file``):
    each tenant's quota in bytes."""
    lines = ["version: 1", "tenants:" if quotas else "tenants: []"]
    for tenant, quota in quotas.items():
        lines += [f'  - name: "{tenant}"', f"    quota: {int(quota)}"]
    return "\n".join(lines) + "\n"


class LocalMaster:
    """``mooncake_master`` on 127.0.0.1 with its HTTP metadata server; logs in ``workdir``.

    ``lease_ttl_ms`` sets the lease a read or lookup puts on an object
    (``--default_kv_lease_ttl``, 10 s by default), during which the master evicts it
    for no one."""

    #: the tenant quota policy file it runs under (:class:`LocalTenantMaster`); None: no tenants
    policy: Path | None = None

    def __init__(self, workdir: Path, *, client_ttl_s: int = 3, lease_ttl_ms: int | None = None) -> None:
        os.environ.setdefault(LOOPBACK_ENV, "127.0.0.1")  # this process's clients (read when one is set up)
        self.bin = wheel_dir()
        self.workdir = workdir
        self.client_ttl_s = client_ttl_s
        self.lease_ttl_ms = lease_ttl_ms
        self.proc: subprocess.Popen[bytes] | None = None
        for attempt in range(3):  # a free port can be taken by another process before the master binds it
            self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
            self.master = f"127.0.0.1:{self.rpc_port}"
            self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
            self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"  # the tier's master_metrics
            try:
                self.start()
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def start(self) -> None:
        """Start (or restart, on the same ports) the master. A restart retries for a
        few seconds when the master exits at once: a port it had can be held for a
        moment by a socket of another process (a connection's local end)."""
        for attempt in range(RESTART_TRIES):
            try:
                self._start_once()
                return
            except RuntimeError as err:
                if "exited with" not in str(err) or attempt == RESTART_TRIES - 1:
                    raise  # not an early exit (or out of tries): a real failure
                time.sleep(0.5)

    def _start_once(self) -> None:
        log = self.workdir / "master.log"
        args = [
            str(self.bin / "mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl_s}",
            "--rpc_thread_num=2",
            "--enable_metric_reporting=false",
        ]
        if self.policy is not None:
            args += [
                "--enable_multi_tenants=true",
                "--tenant_quota_connector_type=file",
                f"--tenant_quota_connector_uri={self.policy}",
            ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        with log.open("ab") as f:
            offset = f.tell()
        self.proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=self.workdir, env=_LOGGING_ENV())

        def ready() -> bool:
            # our own master said so (another process may have taken a port we picked) ...
            text = log.read_bytes()[offset:]
            if b"HTTP metadata server started" not in text or b"Master admin server started" not in text:
                return False
            # ... and both ports answer, as the tier checks before its setup
            return reachable("127.0.0.1", self.rpc_port, 0.2) is None and answers_http(f"{self.metadata}?key=probe", 0.5) is None

        _wait(ready, self.proc, "mooncake_master", log)

    def kill(self) -> None:
        _kill(self.proc)
        self.proc = None

    def options(self, **options: Any) -> dict[str, Any]:
        """The mooncake factory's section for this master (a ``backends:`` entry less ``name``)."""
        return {"master": self.master, "metadata": self.metadata, "local_hostname": "127.0.0.1", **options}

    def section(self, **options: Any) -> dict[str, Any]:
        return {"name": "mooncake", **self.options(**options)}


class LocalTenantMaster(LocalMaster):
    """A :class:`LocalMaster` with ``--enable_multi_tenants`` under the tenant quota
    policy ``quotas`` (tenant -> bytes, written to ``workdir``): each client tenant has
    its own namespace, and the master bounds its bytes by its quota."""

    def __init__(self, workdir: Path, quotas: Mapping[str, int], **options: int) -> None:
        self.policy = workdir / "tenant-quotas.yaml"
        self.policy.write_text(tenant_policy(quotas))
        super().__init__(workdir, **options)


class LocalSegmentOwner:
    """The wheel's ``mooncake_client`` store service, contributing ``size_mib`` of DRAM."""

    def __init__(self, master: LocalMaster, size_mib: int = 256) -> None:
        self.master = master
        self.size_mib = size_mib
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        log = self.master.workdir / f"owner-{self.port}.log"
        args = [
            str(self.master.bin / "mooncake_client"),
            f"--master_server_address={self.master.master}",
            f"--metadata_server={self.master.metadata}",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--global_segment_size={self.size_mib} MB",
            "--local_buffer_size=16 MB",
            "--protocol=tcp",
        ]
        with log.open("ab") as f:
            start = f.tell()
        self.proc = subprocess.Popen(
            args, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=self.master.workdir, env=_LOGGING_ENV()
        )
        _wait(lambda: b"Starting real client service" in log.read_bytes()[start:], self.proc, "mooncake_client", log)

    def kill(self) -> None:
        _kill(self.proc)
        self.proc = None
