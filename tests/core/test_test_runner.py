"""tests/run.py's choice of pytest-xdist arguments for its two runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("lmcache_tests_run", Path(__file__).resolve().parents[1] / "run.py")
assert SPEC is not None and SPEC.loader is not None
run = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(run)

WORKERS = ["-n", "2", "--dist", "worksteal"]


@pytest.fixture
def xdist(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-xdist counted as installed and 2 cores, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: object() if name == "xdist" else real(name))
    monkeypatch.setattr(run, "usable_cores", lambda: 2)
    monkeypatch.delenv("LMCACHE_TEST_JOBS", raising=False)


def test_two_workers_by_default_on_two_cores(xdist: None) -> None:
    assert run.vllm_workers(["-q", "-ra", "--timeout=900"]) == WORKERS
    # the other run by file: a file's servers start once
    assert run.other_workers(["-q", "-ra", "--timeout=900"]) == ["-n", "2", "--dist", "loadfile"]


@pytest.mark.parametrize("args", [["-n", "4"], ["-n4"], ["-n=3"], ["--numprocesses", "3"], ["--numprocesses=auto"]])
def test_an_explicit_n_is_the_callers(xdist: None, args: list[str]) -> None:
    assert run.vllm_workers(["-q", *args]) == []
    assert run.other_workers(["-q", *args]) == []


def test_a_k_expression_that_starts_with_n_is_not_taken_for_n(xdist: None) -> None:
    # control for the test above: only -n options count, not arguments that look alike
    assert run.vllm_workers(["-k", "-name"]) == WORKERS
    assert run.vllm_workers(["-k", "n2"]) == WORKERS


def test_one_job_one_core_or_no_xdist_runs_one_process(xdist: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_TEST_JOBS", "1")
    assert run.vllm_workers([]) == []
    assert run.other_workers([]) == []
    monkeypatch.setenv("LMCACHE_TEST_JOBS", "3")
    assert run.vllm_workers([]) == ["-n", "3", "--dist", "worksteal"]
    monkeypatch.delenv("LMCACHE_TEST_JOBS")
    monkeypatch.setattr(run, "usable_cores", lambda: 1)
    assert run.vllm_workers([]) == []
    monkeypatch.setattr(run, "usable_cores", lambda: 2)
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)
    assert run.vllm_workers([]) == []


def test_a_bad_job_count_is_a_clear_error(xdist: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_TEST_JOBS", "two")
    with pytest.raises(SystemExit, match="LMCACHE_TEST_JOBS='two': expected a number of workers"):
        run.vllm_workers([])


def test_usable_cores_follow_this_process_affinity() -> None:
    import os

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    assert run.usable_cores() == len(os.sched_getaffinity(0))
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to narrow")
    # a process limited to one core of several runs the vLLM tests in one process
    tests = str(Path(__file__).resolve().parents[1])
    code = (
        f"import os, sys; sys.path.insert(0, {tests!r}); os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}}); "
        "import run; print(run.usable_cores(), run.vllm_workers([]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "LMCACHE_TEST_JOBS": ""}
    )
    assert out.stdout.split(None, 1) == ["1", "[]\n"]
