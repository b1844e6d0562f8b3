"""``lmcache-core demo`` as a user runs it (the console script, a child process): a
short first screen (what it does, a progress bar, the result table), vLLM's output in
its log file at WARNING, and a model saved in the dtype vLLM runs it in (no casts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = Path(sys.executable).with_name("lmcache-core")


def test_quick_demo_first_screen_is_short_and_quiet(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_CORE_", "VLLM_LOGGING"))}
    res = subprocess.run(
        [str(SCRIPT), "demo", "--quick", "--docs", "2", "--doc-tokens", "600", "--model-dir", str(tmp_path / "model")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    screen = res.stdout.replace("\r", "\n")
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(lines) <= 20, res.stdout  # the progress bar redraws in place (\r): one line
    assert screen.startswith("lmcache-core demo: 2 documents of 600 tokens")
    assert re.search(r"requests \(cold pass, then warm\): 100%", screen)
    table = re.search(r"^doc 1 +624 +\d+ +\d+ +[\d.]+x +512 +512$", res.stdout, re.M)
    assert table, res.stdout  # a warm hit: 2 chunks of 256 tokens loaded by lmcache-core
    assert "INFO" not in res.stdout + res.stderr and res.stderr.strip() == "", res.stderr[-2000:]
    log = (tmp_path / "demo-vllm.log").read_text()
    assert "WARNING" in log and " INFO " not in log  # vLLM's own output, at WARNING
    # negative control for the dtype: the log would say "Attempted to load weight ... dtype"
    assert "Attempted to load weight" not in log and "Downcasting" not in log
    assert '"dtype": "bfloat16"' in (tmp_path / "model" / "config.json").read_text()
