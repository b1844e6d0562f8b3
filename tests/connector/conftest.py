"""Helpers for end-to-end tests on real vLLM (CPU build), with a tiny local model."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest


def _one_core_per_worker() -> None:
    """Under pytest-xdist (tests/run.py runs the vLLM tests on 2 workers) a worker's
    engines run their model on one OpenMP thread: in-process engines (and the engine
    processes its tests start: they inherit the variables) through ``OMP_NUM_THREADS``,
    engines in vLLM's multiprocess mode bound to a core of the worker's own through
    ``VLLM_CPU_OMP_THREADS_BIND``. Left alone, each worker's engines spin two OpenMP
    threads on the same 2 cores as the other's: a chat test that takes 60 s alone took
    400 s beside another worker. Variables the caller (or a test) sets win."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])
    if "OMP_NUM_THREADS" not in os.environ:  # a caller's value torch has read already
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)  # torch may have been imported before the variable was set


def freeze_heap() -> None:
    """Collect, then freeze what survives (``gc.freeze``): vLLM runs a full collection
    five times while it builds an engine, each a scan of every object this process
    holds (pytest, torch, vLLM's modules, earlier tests), about 0.4 s apiece in a test
    worker and half of an engine's start-up. Frozen objects are skipped. vLLM's
    engine shutdown unfreezes the heap (``gc.unfreeze``), so :func:`make_llm` freezes
    it again after each engine."""
    gc.collect()
    gc.freeze()


_one_core_per_worker()
vllm = pytest.importorskip("vllm")
freeze_heap()

from lmcache_connector.dev.tiny_model import TEST_SPEC, build_tiny_model, random_prompt  # noqa: E402
from lmcache_connector.transfer_config import tokens_prompt  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _no_canary_sampling() -> Iterator[None]:
    """These tests count hits exactly: the canary (``verify_fraction``, default 1%)
    would recompute a sampled hit instead. Off by default here, also for engines in
    child processes (inherited env); tests of the canary set it in their config."""
    key = "LMCACHE_CORE_VERIFY_FRACTION"
    old = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), TEST_SPEC)


def connector_config(role: str = "kv_both", **extra: Any):
    from lmcache_connector.transfer_config import kv_transfer_config

    return kv_transfer_config(extra, role=role, kv_connector_module_path="lmcache_connector")


@contextmanager
def make_llm(
    model: Path,
    *,
    connector: bool = True,
    role: str = "kv_both",
    prefix_caching: bool = False,
    max_num_batched_tokens: int = 512,
    multiprocess: bool = False,
    extra: dict[str, Any] | None = None,
    **kw: Any,
) -> Iterator[Any]:
    """A vLLM engine on CPU; shut down (connector included) on exit."""
    from vllm import LLM

    if "flask" in sys.modules and not multiprocess:
        pytest.fail(
            "flask is imported in this test process (moto's in-process S3 server does that): vLLM's CPU "
            "start-up inspects every module attribute and flask's request proxies raise outside an app "
            "context. Run the vLLM tests in their own pytest process: python tests/run.py (what tox runs)."
        )
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    args: dict[str, Any] = dict(
        model=str(model),
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=4096,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=prefix_caching,
        seed=0,
    )
    if connector:
        args["kv_transfer_config"] = connector_config(role, **(extra or {}))
    args.update(kw)
    llm = LLM(**args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        freeze_heap()
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def greedy(max_tokens: int = 8, params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, extra_args=extra)


def run(llm: Any, prompts: list[list[int]], sp: Any = None, **kw: Any) -> list[Any]:
    outs = llm.generate([tokens_prompt(p) for p in prompts], sp or greedy(), use_tqdm=False, **kw)
    return outs


def token_ids(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def scheduler_side(llm: Any) -> Any:
    """The connector's scheduler side of an in-process engine (its counters, settles)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector._sched


def worker() -> Any:
    """The worker side of the connector in this process (in-process engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


@pytest.fixture(scope="session")
def reference(tiny_model: Path):
    """Greedy outputs without any connector, computed once per prompt."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def get(prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        missing = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if missing:
            with make_llm(tiny_model, connector=False) as llm:
                for p, ids in zip(missing, token_ids(run(llm, missing, greedy(max_tokens)))):
                    cache[(tuple(p), max_tokens)] = ids
        return [cache[(tuple(p), max_tokens)] for p in prompts]

    return get


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``grace_s``: bounded either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


__all__ = ["make_llm", "random_prompt", "run", "scheduler_side", "token_ids", "worker", "greedy"]


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child process in the repository root that talks in lines over its stdin and
    stdout (stderr dropped); ``env`` on top of this process's environment."""
    return subprocess.Popen(
        args,
        cwd=Path(__file__).resolve().parents[2],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
