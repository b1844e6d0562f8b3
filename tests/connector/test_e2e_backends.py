"""Across processes on real vLLM: engine A (one process) computes and stores; a fresh
engine B (another process, empty CPU tier) loads A's KV from the disk tier, the S3
tier (moto on loopback) or A's peer server, with token-identical outputs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import random_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [random_prompt(700, 401), random_prompt(1000, 402)]
HITS = [512, 768]


def _engine(model: Path, config: dict[str, Any], env: dict[str, str] | None = None, hold: bool = False) -> Any:
    args = [sys.executable, "-m", "tests.connector.engine_proc", str(model), json.dumps(config), json.dumps(PROMPTS)]
    if hold:
        args.append("--hold")
    return subprocess.Popen(
        args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, **(env or {})},
    )


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


def test_s3_tier_across_processes(tiny_model):
    pytest.importorskip("lmcache_backend_s3")
    from tests.backends.s3_server import AWS_ENV, MotoS3

    env_before = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    server = MotoS3()
    try:
        bucket = server.make_bucket()
        cfg = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, server.section(bucket)]}
        a = _run(tiny_model, cfg, AWS_ENV)
        assert a["flushed"]
        objects = server.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0)
        assert objects == 2 + 3
        b = _run(tiny_model, cfg, AWS_ENV)
        _check(a, b, "s3")
    finally:
        server.stop()
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_peer_tier_across_processes(tiny_model):
    pytest.importorskip("lmcache_backend_peer")
    port = _free_port()
    secret = "peer-test-secret-0123456789"
    cfg_a = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, {"name": "peer", "listen": f"127.0.0.1:{port}", "secret": secret}]}
    cfg_b = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, {"name": "peer", "peers": [f"127.0.0.1:{port}"], "secret": secret}]}
    cfg_bad = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, {"name": "peer", "peers": [f"127.0.0.1:{port}"], "secret": "wrong-secret-0123456789"}]}
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
