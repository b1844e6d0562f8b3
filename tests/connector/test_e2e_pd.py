"""Prefill/decode split on real vLLM engines: examples/pd_proxy.py sends each request to
a ``kv_producer`` engine (one token) and then to a ``kv_consumer`` engine, connected
through a shared disk tier. The decode engine's prefill is skipped (its cached tokens
are the prompt's whole chunks, loaded by the connector) and its tokens equal a single
engine's without any connector. Control: with the prefill engine unreachable the same
proxy still answers, from a full recompute (no cached tokens)."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import random_prompt, spawn, stop_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300
PROMPTS = [random_prompt(700, 801), random_prompt(1000, 802)]
# whole 256-token chunks and each prompt's block tail (its last whole 128-token block)
HITS = [512 + 128, 768 + 128]


def _start(args: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    """A child process and the rest of its first output line starting with ``ready``."""
    return _ready(_spawn(args), ready)


def _spawn(args: list[str]) -> subprocess.Popen:
    return spawn(args, {"VLLM_CPU_KVCACHE_SPACE": "1"})


def _ready(proc: subprocess.Popen, ready: str) -> tuple[subprocess.Popen, str]:
    args = proc.args
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not line:
            pytest.fail(f"{args[:4]} exited with {proc.wait(5)} before it was ready")
        if line.startswith(ready):
            return proc, line[len(ready) :].strip()
    proc.kill()
    pytest.fail(f"{args[:4]} not ready within {START_TIMEOUT_S} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()  # engines stop when stdin closes
    if any(str(a).endswith("pd_proxy.py") for a in proc.args):
        stop_process(proc, 60.0)
        return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _engine(model: Path, role: str, tiers: list[dict[str, Any]]) -> subprocess.Popen:
    return _spawn([sys.executable, "-m", "tests.connector.serve_proc", str(model), role, json.dumps({"backends": tiers})])


def _url(proc: subprocess.Popen) -> str:
    return "http://127.0.0.1:" + _ready(proc, "READY ")[1]


def _proxy(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    args = [
        sys.executable,
        str(ROOT / "examples" / "pd_proxy.py"),
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--port",
        "0",
        "--timeout",
        "120",
    ]
    return _start(args, "pd_proxy listening on ")


def _complete(base: str, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pd_proxy_decode_skips_prefill_and_matches_one_engine(tiny_model, reference, tmp_path):
    pytest.importorskip("lmcache_backend_disk")
    ref = reference(PROMPTS + [random_prompt(600, 803)])
    shared = {"name": "disk", "path": str(tmp_path / "kv")}
    # The producer's first tier is the shared one: its saves are done when the prefill
    # answers (a write-behind tier could still be writing when the decode request comes).
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_engine(tiny_model, "kv_producer", [shared]))
        procs.append(_engine(tiny_model, "kv_consumer", [{"name": "local_cpu", "max_size": "256MiB"}, shared]))
        prefill, decode = _url(procs[0]), _url(procs[1])  # both start at once
        proxy, base = _proxy(prefill, decode)
        procs.append(proxy)
        outs = [_complete(base, p) for p in PROMPTS]
        assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs] == HITS
        assert [o["lmcache"]["loaded_tokens"] for o in outs] == [HITS[0], sum(HITS)]
        assert [o["choices"][0]["token_ids"] for o in outs] == ref[:2]
        assert outs[-1]["lmcache"]["saved_tokens"] == 0  # a consumer never saves

        # Control: no prefill engine behind the proxy: same answer, all recomputed.
        lone, lone_base = _proxy(f"http://127.0.0.1:{_dead_port()}", decode)
        procs.append(lone)
        out = _complete(lone_base, random_prompt(600, 803))
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["choices"][0]["token_ids"] == ref[2]
    finally:
        for p in reversed(procs):
            _stop(p)
