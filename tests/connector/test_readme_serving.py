"""The README's serving command and YAML, run as written, serve a repeated completion
from the cache (the documented ``vllm serve`` once could not start on vLLM's CPU
build, and no test ran the documented text).

What the test changes, and nothing else: ``MODEL`` becomes the tiny local model,
``--port 8000`` a free port, and the YAML's absolute tier path (``/var/cache/lmcache``)
a directory under the test's tmp dir. The command runs with ``bash -c`` in a
directory holding the YAML under the name the command's ``config_file`` gives, with
the test's interpreter first on ``PATH`` (so ``python`` is the one with vLLM and the
connector installed), vLLM's default multiprocess engine, and
``VLLM_CPU_KVCACHE_SPACE=1`` (the KV-cache size the README tells CPU users to set).

Controls: after the first completion the cache has saved but loaded nothing (so the
load counted after the second one is a hit, not noise); the disk tier directory the
YAML names fills with chunk files (so the documented YAML, not the embedded default,
configured the connector); test_doc_blocks.py shows that a broken or drifting block
fails before any server starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from . import doc_blocks as db
from .conftest import random_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

START_TIMEOUT_S = 420  # a bound: cold start (torch.compile included) takes 55-75 s on 2 quiet cores, minutes under load
PROMPT_TOKENS = 800  # not a multiple of any likely chunk size: saved == loaded == whole chunks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def _metric(text: str, name: str, label: str = "") -> float:
    """Sum of a counter's samples (optionally only those whose labels contain ``label``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            if label in labels:
                total += float(value)
    return total


def _metrics_when(base: str, name: str, at_least: float, label: str = "", timeout_s: float = 30) -> str:
    """/metrics once ``name`` reaches ``at_least`` (stats reach the front end with the next
    engine step), or the last text seen after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    text = _get(base + "/metrics")
    while _metric(text, name, label) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        text = _get(base + "/metrics")
    return text


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM our child's process group (bash, API server, engine core), SIGKILL what is
    left after 30 s; bounded either way."""
    for sig, grace_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap our direct child so it does not keep the group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@contextmanager
def _serving(script: str, cwd: Path, env: dict[str, str], log_path: Path, port: int) -> Iterator[str]:
    """Run ``script`` with bash in its own process group; yield the base URL once /health
    answers; stop the whole group (API server, engine core) on exit."""
    log = open(log_path, "w")
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"README.md's serving command exited with {proc.returncode} before serving:\n{script}\n"
                    + log_path.read_text()[-4000:]
                )
            try:
                _get(base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"README.md's serving command did not answer /health in {START_TIMEOUT_S} s")
                time.sleep(1)
        yield base
    finally:
        _stop_group(proc)
        log.close()


def test_readme_serving_command_serves_second_completion_from_cache(tiny_model: Path, tmp_path: Path):
    cmd = db.documented_commands()  # README.md and docs/connector.md agree, shape checked
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    doc_yaml = db.documented_yaml(tmp_path)
    (workdir / cmd.config_file()).write_text(doc_yaml.text)
    chunk = int(yaml.safe_load(doc_yaml.text)["chunk_size"])
    whole_chunks = PROMPT_TOKENS // chunk
    assert whole_chunks >= 1, f"README.md's chunk_size {chunk} is larger than the test prompt: raise PROMPT_TOKENS"
    expected = whole_chunks * chunk
    port = _free_port()
    script = cmd.substituted(str(tiny_model), port)

    bindir = Path(sys.executable).parent
    assert (bindir / "python").exists(), f"{bindir} has no 'python': the README command needs one on PATH"
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default, as a user runs it
    env.pop("LMCACHE_CORE_CONFIG", None)

    with _serving(script, workdir, env, tmp_path / "server.log", port) as base:
        prompt = random_prompt(PROMPT_TOKENS, 2101)
        body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        first = _post(base + "/v1/completions", body)
        assert first["usage"]["prompt_tokens"] >= PROMPT_TOKENS
        after_first = _metrics_when(base, "lmcache_core:saved_tokens_total", expected)
        assert _metric(after_first, "lmcache_core:saved_tokens_total") == expected
        assert _metric(after_first, "lmcache_core:loaded_tokens_total") == 0, "a first request cannot hit"

        second = _post(base + "/v1/completions", body)
        after_second = _metrics_when(base, "lmcache_core:loaded_tokens_total", 1)
        # the disk tier is written behind the CPU tier: wait until it holds every chunk
        cpu_bytes = _metric(after_second, "lmcache_core:tier_put_bytes_total", 'tier="local_cpu"')
        after_disk = _metrics_when(base, "lmcache_core:tier_put_bytes_total", cpu_bytes, 'tier="disk"')

    loaded = _metric(after_second, "lmcache_core:loaded_tokens_total")
    assert loaded == expected, f"second completion loaded {loaded} tokens from the cache, expected {expected}"
    # the server shape picks background saves (connector.async_saves: auto), and the
    # second request still hit what the first one saved
    assert "saves run in the background (async_saves: auto)" in (tmp_path / "server.log").read_text(errors="replace")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert cpu_bytes > 0
    assert _metric(after_disk, "lmcache_core:tier_put_bytes_total", 'tier="disk"') == cpu_bytes

    (disk_dir,) = doc_yaml.rewrites.values()
    chunk_files = [p for p in Path(disk_dir).rglob("v1-*") if p.is_file()]
    assert len(chunk_files) == whole_chunks, (
        f"the YAML's disk tier ({disk_dir}) holds {len(chunk_files)} chunk files, expected {whole_chunks}: "
        "was the documented YAML used?"
    )
