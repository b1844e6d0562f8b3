"""Across processes on real vLLM: engine A (one process) computes and stores; a fresh
engine B (another process, empty CPU tier) loads A's KV from the disk tier, the S3
tier (moto on loopback) or A's peer server, with token-identical outputs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import random_prompt, spawn

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [random_prompt(700, 401), random_prompt(1000, 402)]
# whole 256-token chunks, then each prompt's block tail (its last whole 128-token block)
HITS = [512 + 128, 768 + 128]
OBJECTS = 2 + 3 + 2  # stored: the chunks of both prompts and their block tails


def _engine(model: Path, config: dict[str, Any], env: dict[str, str] | None = None, hold: bool = False) -> Any:
    args = [sys.executable, "-m", "tests.connector.engine_proc", str(model), json.dumps(config), json.dumps(PROMPTS)]
    if hold:
        args.append("--hold")
    return spawn(args, env)


def _result(proc: Any, timeout: float = 300) -> dict[str, Any]:
    if proc.stdin and not proc.stdin.closed and "--hold" not in proc.args:
        proc.stdin.close()
    for _ in range(10_000):  # vLLM prints to stdout too; bounded
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=timeout)
            pytest.fail(f"engine process exited with {proc.returncode} and no result")
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    pytest.fail("no result line from the engine process")


def _run(model: Path, config: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = _engine(model, config, env)
    out = _result(proc)
    proc.wait(timeout=120)
    return out


def _check(a: dict[str, Any], b: dict[str, Any], tier: str) -> None:
    assert a["cached"] == [0, 0]
    assert b["cached"] == HITS
    assert b["loaded_tokens"] == sum(HITS)
    assert b["tokens"] == a["tokens"]
    hits = {t["name"]: t["hits"] for t in b["tiers"]}
    assert hits.get(tier, 0) >= 1 or tier == "peer"


def test_disk_tier_across_processes(tiny_model, tmp_path):
    pytest.importorskip("lmcache_backend_disk")
    cfg = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, {"name": "disk", "path": str(tmp_path / "kv")}]}
    a = _run(tiny_model, cfg)
    assert a["flushed"]
    b = _run(tiny_model, cfg)
    _check(a, b, "disk")


def _moto_process(port: int) -> Any:
    """moto's S3 server in its own process: importing it here would put flask in
    this process, and vLLM's CPU start-up trips over flask's context proxies."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):  # bounded: 10 s
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    pytest.fail("moto S3 server did not start")


def test_s3_tier_across_processes(tiny_model):
    pytest.importorskip("lmcache_backend_s3")
    import boto3
    from botocore.config import Config

    env = {
        "AWS_ACCESS_KEY_ID": "AKIATESTLMCACHE00001",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-lmcache-e2e",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    port = _free_port()
    server = _moto_process(port)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}),
        )
        s3.create_bucket(Bucket="lmcache-e2e")
        section = {"name": "s3", "bucket": "lmcache-e2e", "endpoint_url": endpoint, "addressing_style": "path"}
        cfg = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, section]}
        a = _run(tiny_model, cfg, env)
        assert a["flushed"]
        assert s3.list_objects_v2(Bucket="lmcache-e2e", Prefix="lmcache/v1-").get("KeyCount", 0) == OBJECTS
        b = _run(tiny_model, cfg, env)
        _check(a, b, "s3")
    finally:
        server.terminate()
        server.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_peer_tier_across_processes(tiny_model):
    pytest.importorskip("lmcache_backend_peer")
    port = _free_port()
    secret = "peer-test-secret-0123456789"
    cfg_a = {
        "backends": [
            {"name": "local_cpu", "max_size": "128MiB"},
            {"name": "peer", "listen": f"127.0.0.1:{port}", "secret": secret},
        ]
    }
    cfg_b = {
        "backends": [
            {"name": "local_cpu", "max_size": "128MiB"},
            {"name": "peer", "peers": [f"127.0.0.1:{port}"], "secret": secret},
        ]
    }
    cfg_bad = {
        "backends": [
            {"name": "local_cpu", "max_size": "128MiB"},
            {"name": "peer", "peers": [f"127.0.0.1:{port}"], "secret": "wrong-secret-0123456789"},
        ]
    }
    proc_a = _engine(tiny_model, cfg_a, hold=True)
    try:
        a = _result(proc_a)
        assert a["flushed"]
        bad = _run(tiny_model, cfg_bad)
        assert bad["cached"] == [0, 0]  # a wrong secret gets nothing
        b = _run(tiny_model, cfg_b)
        _check(a, b, "peer")
    finally:
        proc_a.stdin.close()
        proc_a.wait(timeout=120)


def test_two_engines_share_one_cache_node(tiny_model, tmp_path):
    """Several engines on one node share KV through a node-local ``lmcache-core serve``
    node: engine A (its own process) pushes what it computes to the node and keeps
    nothing itself; a fresh engine B hits all of it through the node, token-identical.
    An engine with the wrong secret gets nothing (the control)."""
    pytest.importorskip("lmcache_backend_peer")
    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from peer_node import PeerNode

    secret = tmp_path / "secret"
    secret.write_text("node-secret-0123456789abcdef")
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-secret-0123456789abcdef")
    node = PeerNode(["--max-size", "128MiB"], secret_file=secret)
    try:

        def cfg(secret_file: Path) -> dict[str, Any]:
            peer = {"name": "peer", "peers": [node.address], "secret_file": str(secret_file), "push": True, "max_size": 0}
            return {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, peer]}

        a = _run(tiny_model, cfg(secret))
        assert a["flushed"] and a["cached"] == [0, 0]
        bad = _run(tiny_model, cfg(wrong))
        assert bad["cached"] == [0, 0]
        b = _run(tiny_model, cfg(secret))
        _check(a, b, "peer")
    finally:
        node.stop()


def test_two_engines_share_one_cache_node_through_shared_memory(tiny_model, tmp_path):
    """The same on one host through the node's Unix socket: engine A pushes over the
    socket; a fresh engine B loads every hit straight from the node's shared memory
    (its peer tier counts shm hits), token-identical. The control: engine C on the
    same socket with ``shm: false`` hits the same through the socket, with no shm hit."""
    pytest.importorskip("lmcache_backend_peer")
    from lmcache_backend_peer.shm import SHM_SUPPORTED

    if not SHM_SUPPORTED:
        pytest.skip("the shared-memory fast path is x86-64 Linux only")
    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from peer_node import PeerNode

    secret = tmp_path / "secret"
    secret.write_text("node-secret-0123456789abcdef")
    sock = tmp_path / "node.sock"
    node = PeerNode(["--max-size", "128MiB", "--unix-socket", str(sock)], secret_file=secret)
    try:

        def cfg(shm: bool, push: bool) -> dict[str, Any]:
            peer = {"name": "peer", "unix_socket": str(sock), "shm": shm, "secret_file": str(secret), "push": push, "max_size": 0}
            return {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, peer]}

        a = _run(tiny_model, cfg(True, True))
        assert a["flushed"] and a["cached"] == [0, 0]
        b = _run(tiny_model, cfg(True, False))
        _check(a, b, "peer")
        assert {t["name"]: t["shm_hits"] for t in b["tiers"]}["peer"] == OBJECTS
        c = _run(tiny_model, cfg(False, False))
        _check(a, c, "peer")
        assert {t["name"]: t["shm_hits"] for t in c["tiers"]}["peer"] == 0
    finally:
        node.stop()
