"""``vllm serve`` with the connector: an OpenAI-compatible server on 127.0.0.1 whose
``/metrics`` shows the connector's ``lmcache_core:`` counters after a cache hit, and
a real Prometheus scraping it finds data for every query of deploy/'s dashboard and
every series its alert rules read (docs/metrics.md)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import random_prompt, stop_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


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


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
            if m:
                total += float(m.group(2))
    return total


def test_vllm_serve_exports_connector_metrics(tiny_model, tmp_path):
    port = _free_port()
    ktc = {
        "kv_connector": "LMCacheCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--max-model-len",
            "4096",
            "--max-num-batched-tokens",
            "1024",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--kv-transfer-config",
            json.dumps(ktc),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail("server exited:\n" + (tmp_path / "server.log").read_text()[-4000:])
            try:
                if _get(base + "/health") is not None:
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("server did not start in 240 s")
        prompt = random_prompt(800, 301)
        body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        first = _post(base + "/v1/completions", body)
        second = _post(base + "/v1/completions", body)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        # the canary, forced for one request: recomputed and compared, not loaded
        third = _post(base + "/v1/completions", {**body, "kv_transfer_params": {"lmcache.verify": True}})
        assert third["choices"][0]["text"] == first["choices"][0]["text"]
        text = ""
        for _ in range(30):  # stats reach the front end with the next engine step
            text = _get(base + "/metrics")
            if _metric(text, "lmcache_core:loaded_tokens_total") > 0 and _metric(text, "lmcache_core:verified_chunks_total") >= 3:
                break
            time.sleep(1)
        assert _metric(text, "lmcache_core:loaded_tokens_total") == 768
        assert _metric(text, "lmcache_core:saved_tokens_total") == 768
        assert _metric(text, "lmcache_core:lookups_total") >= 2
        assert _metric(text, "lmcache_core:tier_put_bytes_total") > 0
        assert 'tier="local_cpu"' in text
        # occupancy gauges: the 3 stored chunks, against the embedded default's budget
        assert _metric(text, "lmcache_core:tier_used_bytes") == _metric(text, "lmcache_core:tier_put_bytes_total")
        assert _metric(text, "lmcache_core:tier_capacity_bytes") > _metric(text, "lmcache_core:tier_used_bytes") > 0
        assert _metric(text, "lmcache_core:verified_chunks_total") == 3
        assert _metric(text, "lmcache_core:verify_mismatches_total") == 0
        _dashboard_and_alerts_have_data(f"127.0.0.1:{port}", base, body, tmp_path)
    finally:
        stop_process(proc)
        log.close()


def _dashboard_and_alerts_have_data(target: str, base: str, body: dict, tmp_path) -> None:
    """Debian's prometheus scraping the server every second: every dashboard query,
    and every series an alert rule reads, returns data (none silently empty)."""
    import shutil

    from tests.deploy.prom import MISSING, alert_rules, dashboard_queries, prometheus, selectors

    if shutil.which("prometheus") is None:
        pytest.skip(MISSING)
    with prometheus(target, tmp_path) as prom:
        for _ in range(2):  # traffic while it scrapes, so rates have two samples that differ
            _post(base + "/v1/completions", body)
        read = set().union(*(selectors(r["expr"]) for r in alert_rules()))
        deadline = time.monotonic() + 60  # a loaded machine scrapes late: wait (bounded) for the samples
        while True:
            time.sleep(2)
            empty = [f"{title}: {expr}" for title, expr in dashboard_queries() if not prom.query(expr)]
            missing = sorted(m for m in read if not prom.query(m))
            if not empty and not missing or time.monotonic() > deadline:
                break
        assert empty == [], "dashboard queries without data:\n" + "\n".join(empty)
        assert missing == [], f"series the alert rules read that Prometheus does not have: {missing}"
        assert prom.query("lmcache_core:loaded_tokens_total > 0")  # control: a query that can be empty is not
        assert not prom.query("lmcache_core:verify_mismatches_total > 0")
