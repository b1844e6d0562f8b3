"""The servers a benchmark starts beside itself, each on 127.0.0.1 in its own process
(so it does not share the benchmark's GIL), every wait bounded:

- moto's S3 (``moto_server``, ``start_moto``): moto accepts any credentials, so
  ``aws_credentials()`` gives boto3 some;
- a ``redis-server`` with no persistence (``redis_server``, ``start_redis``);
- ``lmcache-peer-serve`` (``start_peer_serve``), or an ``lmcache-core serve`` node
  (``console_script`` and ``first_line``: a node says where it listens on its first
  lines).

The in-process Mooncake master and segment owner are the backend's own
(``lmcache_backend_mooncake.local``); vLLM's OpenAI server is in ``lib.openai_server``.
"""

from __future__ import annotations

import os
import queue
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

MOTO_CHILD = """
import sys, logging
logging.disable(logging.INFO)
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s._server.server_port, flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
s.stop()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    """Until something accepts on 127.0.0.1:``port``; RuntimeError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s")


def first_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The next line a child prints (stripped); kills it and raises RuntimeError when
    none comes in ``timeout`` seconds or it exits first."""
    q: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: q.put(proc.stdout.readline() if proc.stdout else ""), daemon=True).start()
    try:
        line = q.get(timeout=timeout).strip()
    except queue.Empty:
        line = ""
    if not line:
        proc.kill()
        raise RuntimeError(f"child {proc.args!r} printed no line within {timeout:g} s (did it start?)")
    return line


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate ``proc``; kill it if it has not exited after ``timeout`` s."""
    proc.terminate()
    wait_or_kill(proc, timeout)


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    """Wait ``timeout`` s for ``proc`` to exit; kill it if it has not."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


@contextmanager
def healthy_process(
    cmd: list[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    health_url: str,
    start_timeout: float,
    name: str,
    poll_s: float = 1.0,
) -> Iterator[subprocess.Popen]:
    """``cmd`` in its own process group, its output in ``log_path``; yields it once
    ``health_url`` answers, RuntimeError naming ``name`` if it exits first or does not
    answer within ``start_timeout`` seconds. Stopped on exit: SIGINT to its process
    group, SIGKILL after 30 s."""
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: exited ({proc.returncode}); see {log_path}")
            try:
                with urllib.request.urlopen(health_url, timeout=2) as r:  # noqa: S310 - loopback only
                    r.read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: not up after {start_timeout} s; see {log_path}") from None
                time.sleep(poll_s)
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        logf.close()


def console_script(name: str) -> str:
    """The path of this environment's console script ``name`` (``lmcache-core``,
    ``lmcache-peer-serve``), whichever interpreter runs the benchmark."""
    return shutil.which(name, path=os.path.dirname(sys.executable)) or name


# -- cache nodes ---------------------------------------------------------------------------
@dataclass
class CacheNode:
    """A running ``lmcache-core serve`` node (see ``start_cache_node``)."""

    proc: subprocess.Popen
    address: str  # host:port on loopback TCP
    secret_file: Path
    unix_socket: str | None = None  # its socket path, offering shared memory, when asked for


def start_cache_node(tmp: Path, max_size: str, *, unix_socket: bool = False) -> CacheNode:
    """An ``lmcache-core serve`` node on a free loopback port, a fresh secret in
    ``tmp/secret``; with ``unix_socket`` also on ``tmp/node.sock``, where it must offer
    shared memory (RuntimeError otherwise). Stop it with ``stop(node.proc)``."""
    secret = tmp / "secret"
    secret.write_text(os.urandom(24).hex())
    sock = str(tmp / "node.sock") if unix_socket else None
    cmd = [console_script("lmcache-core"), "serve", "--listen", "127.0.0.1:0", "--secret-file", str(secret)]
    cmd += ["--max-size", max_size, *(["--unix-socket", sock] if sock else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    if sock is not None:
        local = first_line(proc)  # the node names its local socket first
        if "shared memory" not in local:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the cache node offers no shared memory here: {local!r}")
    address = first_line(proc).removeprefix("listening on ").split()[0]
    return CacheNode(proc, address, secret, sock)


# -- lmcache-peer-serve ------------------------------------------------------------------
def start_peer_serve(
    max_size: int | str, secret_file: Path | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """A standalone cache node (``lmcache-peer-serve``) on a free loopback port, its
    secret from ``secret_file`` (or ``LMCACHE_PEER_SECRET`` in ``env``):
    (process, host:port), once it says where it listens."""
    secret = ["--secret-file", str(secret_file)] if secret_file is not None else []
    proc = subprocess.Popen(
        [console_script("lmcache-peer-serve"), "--listen", "127.0.0.1:0", *secret, "--max-size", str(max_size)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc, first_line(proc).removeprefix("listening on ")


# -- moto's S3 ---------------------------------------------------------------------------
def aws_credentials() -> None:
    """Credentials for boto3 (moto accepts any), unless the environment has some."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def start_moto(timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """moto's S3 in a child process: (process, endpoint URL). Stop it with ``stop_moto``."""
    proc = subprocess.Popen([sys.executable, "-c", MOTO_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{int(first_line(proc, timeout))}"


def stop_moto(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.stdin:
        proc.stdin.close()
    wait_or_kill(proc, timeout)


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 for the block: yields its endpoint URL."""
    proc, endpoint = start_moto()
    try:
        yield endpoint
    finally:
        stop_moto(proc)


# -- redis-server --------------------------------------------------------------------------
def start_redis(data_dir: Path | str, timeout: float = 10.0) -> tuple[subprocess.Popen, int]:
    """A ``redis-server`` on a free loopback port, no persistence, working in
    ``data_dir``: (process, port), once it accepts connections."""
    binary = shutil.which("redis-server")
    if not binary:
        raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, timeout)
    except RuntimeError:
        proc.kill()
        proc.wait(timeout)
        raise RuntimeError(f"redis-server did not accept connections on port {port} within {timeout:g} s") from None
    return proc, port


@contextmanager
def redis_server(data_dir: Path | str) -> Iterator[int]:
    """A ``redis-server`` for the block (see ``start_redis``): yields its port."""
    proc, port = start_redis(data_dir)
    try:
        yield port
    finally:
        stop(proc)
