"""A real Prometheus (Debian's ``prometheus``) on loopback for the deploy/ checks."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "lmcache-core-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "lmcache-core-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "lmcache-core-alerts.test.yml"
MISSING = "Debian's prometheus is not installed (apt-get install prometheus; .ci/run installs it)"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every target of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def selectors(expr: str) -> set[str]:
    """The metric names an expression reads."""
    return set(re.findall(r"\b((?:lmcache_core|vllm):[a-z_]+)", expr))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:  # noqa: S310 - loopback only
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])


@contextmanager
def prometheus(target: str, tmp: Path, job: str = "vllm", wait_s: float = 60, **scrape: Any) -> Iterator[Prometheus]:
    """Prometheus scraping ``target`` (host:port, path /metrics) every second as
    ``job`` (``scrape``: more keys of its scrape config, e.g. ``authorization``), with
    the alert rules loaded; stopped on exit."""
    binary = shutil.which("prometheus")
    assert binary, MISSING
    port = _free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}], **scrape}],
            }
        )
    )
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(
        [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if prom.query(f'up{{job="{job}"}} == 1'):
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"Prometheus did not scrape the server in {wait_s:g} s"
            time.sleep(0.5)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
