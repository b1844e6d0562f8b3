"""Real ``redis-server`` processes on loopback for the redis tier's tests.

Never the system service: every server is started here on a free 127.0.0.1 port with
its own temp dir (no RDB/AOF unless asked), and stopped by the test that started it.
Tests skip with the reason when the binary is missing (``.ci/run`` installs Debian's
``redis-server``; locally: ``apt-get install redis-server``).

Fixtures: ``redis_server`` (one plain server per session), ``redis_cluster`` (three
masters, slots split evenly, one per session). ``RedisServer`` / ``RedisCluster3``
start extra ones for tests that kill, pause or misconfigure a server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis

BINARY = os.environ.get("LMCACHE_TEST_REDIS_SERVER", "redis-server")
SLOTS = 16384


def redis_binary() -> str:
    path = shutil.which(BINARY)
    if path is None:
        pytest.skip(
            f"{BINARY!r} not found on PATH: install it (`apt-get install redis-server`, which .ci/run does) "
            "or point LMCACHE_TEST_REDIS_SERVER at a redis-server / valkey-server binary"
        )
    return path


def free_port(max_port: int = 65535) -> int:
    """A free loopback port at most ``max_port`` (a cluster node also needs port + 10000)."""
    for _ in range(200):  # bounded
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port <= max_port:
            return port
    raise RuntimeError(f"no free loopback port at most {max_port} after 200 tries")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; ``port`` is kept across :meth:`restart`."""

    def __init__(self, *args: str, password: str | None = None, port: int | None = None) -> None:
        self.binary = redis_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="lmc-redis-"))
        self.port = port or free_port(55535 if "--cluster-enabled" in args else 65535)
        self.password = password
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "log"),
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd + self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # bounded: 10 s
            if self.proc.poll() is not None:
                log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log[-2000:]}")
            try:
                self.client().ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within 10 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster3:
    """Three cluster-enabled masters on loopback, slots split evenly; with
    ``replica=True`` a fourth node replicates the first master (for failover)."""

    def __init__(self, *, replica: bool = False, node_timeout_ms: int = 2000, ports: list[int] | None = None) -> None:
        self.nodes: list[RedisServer] = []
        self.replica: RedisServer | None = None
        self._args = (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--repl-diskless-sync-delay",
            "0",
        )
        try:
            for port in ports or [0, 0, 0]:
                self.nodes.append(RedisServer(*self._args, port=port or None))
            self._form()
            if replica:
                self._add_replica()
        except BaseException:
            self.stop()
            raise

    def _form(self) -> None:
        clients = [n.client() for n in self.nodes]
        for i, c in enumerate(clients):
            lo, hi = i * SLOTS // 3, (i + 1) * SLOTS // 3 - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for n in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
        self._wait_ok(self.nodes, known=3)

    def _wait_ok(self, nodes: list[RedisServer], known: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # bounded
            texts = [n.client().execute_command("CLUSTER", "INFO").decode() for n in nodes]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{known}" in t for t in texts):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not reach cluster_state:ok with {known} nodes within {timeout:.0f} s")

    def _add_replica(self) -> None:
        self.replica = RedisServer(*self._args)
        master_id = self.nodes[0].client().execute_command("CLUSTER", "MYID").decode()
        self.nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", self.replica.port)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # bounded: the replica must know the master first
            try:
                self.replica.client().execute_command("CLUSTER", "REPLICATE", master_id)
                break
            except redis.exceptions.ResponseError:
                time.sleep(0.1)
        while time.monotonic() < deadline:
            if self.replica.client().info("replication").get("master_link_status") == "up":
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("the replica did not sync with its master within 20 s")
        self._wait_ok([*self.nodes, self.replica], known=4)

    @property
    def seeds(self) -> list[str]:
        return [n.node for n in self.nodes]

    def node_ids(self) -> list[str]:
        return [n.client().execute_command("CLUSTER", "MYID").decode() for n in self.nodes]

    def keys_per_node(self, prefix: str) -> list[int]:
        return [len(n.client().keys(prefix + "*")) for n in self.nodes]

    def stop(self) -> None:
        for n in [*self.nodes, *([self.replica] if self.replica else [])]:
            n.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster3]:
    redis_binary()
    cluster = RedisCluster3()
    try:
        yield cluster
    finally:
        cluster.stop()
