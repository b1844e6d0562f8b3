"""vLLM's OpenAI server as the unit under test (bench_serving, bench_serving_soak,
bench_remote_ttft): the model it serves, one fresh server per arm with the
processes its tiers need, bounded start-up and shutdown, and what its processes
use (resident memory, CPU time) by role.

The server is ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with
vLLM's default multiprocessing and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
(docs/deployment.md); ``server`` waits for ``/health`` at most
``args.start_timeout`` seconds and checks that vLLM made the KV cache the arm asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lib import servers

MODEL_KW = dict(hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048, vocab_size=4096)
"""The demo's model: 6 layers, 4 KV heads of 64, bf16: 6 KiB of KV per token."""
KV_PER_TOKEN = 6 * 2 * 4 * 64 * 2


def log(*a: Any) -> None:
    print(*a, flush=True)


def build_model() -> Path:
    from lmcache_connector.dev.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(**MODEL_KW)
    return build_tiny_model(Path.home() / ".cache" / "lmcache-core" / f"serving-{spec.tag()}", spec)


@dataclass
class Arm:
    name: str
    connector: bool = False
    kv_bytes: int = 0
    max_num_seqs: int | None = None
    tiers: str = "cpu"  # cpu | disk | node | redis
    cpu_size: str = "2GiB"  # the CPU tier of tiers=cpu
    eviction: str | None = None  # the CPU tier's policy (None: the default)
    chunk_size: int = 256
    prefix_caching: bool = True
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the server
    overrides: dict[str, Any] = field(default_factory=dict)  # lmcache-core settings, dotted keys (--variant)


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read().decode()


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
            if m:
                total += float(m.group(2))
    return total


@contextmanager
def helper_services(arm: Arm, tmp: Path, config: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """The tier configuration for ``arm`` (``config`` when given) and whatever process
    it needs (a cache node, a redis-server), stopped afterwards."""
    procs: list[subprocess.Popen] = []
    cfg: dict[str, Any] = dict(config) if config is not None else {"chunk_size": arm.chunk_size}
    small_cpu = {"name": "local_cpu", "max_size": "64MiB"}
    try:
        if config is not None:
            pass
        elif arm.tiers == "cpu":
            cpu: dict[str, Any] = {"name": "local_cpu", "max_size": arm.cpu_size}
            if arm.eviction is not None:
                cpu["eviction"] = arm.eviction
            cfg["backends"] = [cpu]
        elif arm.tiers == "disk":
            cfg["backends"] = [small_cpu, {"name": "disk", "path": str(tmp / "disk"), "max_size": "4GiB"}]
        elif arm.tiers == "node":
            node = servers.start_cache_node(tmp, "2GiB", unix_socket=True)
            procs.append(node.proc)
            cfg["backends"] = [
                small_cpu,
                {
                    "name": "peer",
                    "unix_socket": node.unix_socket,
                    "shm": True,
                    "secret_file": str(node.secret_file),
                    "max_size": 0,
                    "timeout_s": 30.0,
                },
            ]
        elif arm.tiers == "redis":
            p, port = servers.start_redis(tmp)
            procs.append(p)
            cfg["backends"] = [small_cpu, {"name": "redis", "url": f"redis://127.0.0.1:{port}/0"}]
        for dotted, value in arm.overrides.items():
            *parents, last = dotted.split(".")
            node = cfg
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        yield cfg
    finally:
        for p in procs:
            servers.stop(p)


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a server runs in: ours, with one core left to the API process
    (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), vLLM's default multiprocessing, and ``extra``."""
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default, as users run it
    env.update(extra or {})
    return env


@contextmanager
def openai_server(
    name: str,
    server_args: list[str],
    env: dict[str, str],
    log_path: Path,
    start_timeout: float,
    python: str = sys.executable,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m vllm.entrypoints.openai.api_server *server_args`` on a free loopback
    port (``python``: this interpreter unless another environment's is given), its output in ``log_path``; yields (base URL, process) once ``/health``
    answers, RuntimeError if it exits first or is not up after ``start_timeout``
    seconds. Stopped on exit: SIGINT to its process group, SIGKILL after 30 s."""
    port = servers.free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", *server_args, "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with servers.healthy_process(
        cmd, env=env, log_path=log_path, health_url=base + "/health", start_timeout=start_timeout, name=f"{name}: server"
    ) as proc:
        yield base, proc


def vllm_args(arm: Arm, model: Path, args: argparse.Namespace) -> list[str]:
    """The server options every arm shares: the model, eager mode, ``args.max_model_len``
    and ``args.max_batched``, the arm's KV cache size, prefix caching and running requests."""
    cmd = [
        "--model",
        str(model),
        "--enforce-eager",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-batched-tokens",
        str(args.max_batched),
        "--kv-cache-memory-bytes",
        str(arm.kv_bytes),
        "--seed",
        "0",
        "--enable-prefix-caching" if arm.prefix_caching else "--no-enable-prefix-caching",
    ]
    if arm.max_num_seqs:
        cmd += ["--max-num-seqs", str(arm.max_num_seqs)]
    return cmd


def arm_env(arm: Arm) -> dict[str, str]:
    """The environment of ``arm``'s server: ``server_env()`` plus the arm's own."""
    env = server_env()
    # vLLM-CPU's legacy VLLM_CPU_KVCACHE_SPACE (a user's environment may set it) overrides
    # --kv-cache-memory-bytes: left in, every arm would get its size and the small
    # cache of vllm/lmc-* would silently be as large as the limit's
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(arm.env)
    return env


@contextmanager
def server(
    arm: Arm, model: Path, args: argparse.Namespace, tmp: Path, config: dict[str, Any] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A fresh OpenAI server for ``arm`` (lmcache-core's tiers from ``config`` when
    given), ``args.max_model_len``, ``args.max_batched`` and ``args.start_timeout``
    from the benchmark's options; yields (base URL, process)."""
    with helper_services(arm, tmp, config) as cfg:
        cmd = vllm_args(arm, model, args)
        env = arm_env(arm)
        if arm.connector:
            yaml_path = tmp / f"{arm.name}.yaml"
            yaml_path.write_text(json.dumps(cfg))  # JSON is YAML
            cmd += connector_args(yaml_path)
        log_path = tmp / f"{arm.name}.server.log"
        with openai_server(arm.name, cmd, env, log_path, args.start_timeout) as (base, proc):
            check_kv_size(log_path, arm)
            yield base, proc


def connector_args(config_file: Path) -> list[str]:
    """The server options that load lmcache-core's connector with ``config_file``."""
    ktc = {
        "kv_connector": "LMCacheCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_file": str(config_file)},
    }
    return ["--kv-transfer-config", json.dumps(ktc)]


def check_kv_size(log: Path, arm: "Arm") -> None:
    """The size vLLM's log says it gave the KV cache ("KV cache size: N tokens") must fit
    the bytes the arm asked for: an environment setting that overrides the flag (vLLM-CPU's
    VLLM_CPU_KVCACHE_SPACE) would make the small-cache arms as large as the limit."""
    m = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    if m is None:
        return  # the message changed: nothing to compare
    tokens = int(m.group(1).replace(",", ""))
    per_token = KV_PER_TOKEN
    if tokens * per_token > arm.kv_bytes * 1.05:
        raise RuntimeError(
            f"{arm.name}: vLLM made a KV cache of {tokens} tokens ({tokens * per_token >> 20} MiB) "
            f"but the arm asked for {arm.kv_bytes >> 20} MiB; is VLLM_CPU_KVCACHE_SPACE set?"
        )


def _role(p: Any, root_pid: int) -> str:
    if p.pid == root_pid:
        return "api"
    name = p.name()
    if "EngineCore" in name:
        return "engine-core"
    if "Worker" in name:
        return "worker"
    return name


def _per_role(proc: subprocess.Popen, measure: Any) -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                role = _role(p, root.pid)
                out[role] = out.get(role, 0.0) + measure(p)
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return out


def rss_mib(proc: subprocess.Popen) -> dict[str, float]:
    """Resident memory of the server's processes, by role (api, engine-core, worker)."""
    return _per_role(proc, lambda p: p.memory_info().rss / 2**20)


def cpu_seconds(proc: subprocess.Popen) -> dict[str, float]:
    """CPU time (user + system) the server's processes have used, by role: a measure
    of work done that the machine's noise moves far less than wall-clock figures."""
    return _per_role(proc, lambda p: p.cpu_times().user + p.cpu_times().system)
