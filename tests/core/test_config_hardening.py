"""Config edge cases end as a clear ConfigError naming the file (or env var) and key, in
bounded time and memory.

Figures checked: the 605-byte YAML alias bomb and ``/dev/zero`` as a config file
make ``lmcache-core config --show`` exit 2 in < 5 s with < 64 MiB peak RSS growth,
under an address-space limit of 256 MiB above the imports (a fresh subprocess,
``resource.getrusage`` and ``RLIMIT_AS``; a valid config shown by the same process
is the control);
a CPU tier larger than the machine's available memory is refused before any
allocation; sizes use exact arithmetic; peer secrets under 16 bytes are refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmcache_core.config import MAX_SIZE_BYTES, ConfigError, load_config, parse_size
from lmcache_core.engine import CacheEngine
from lmcache_core.keys import KeyNamespace
from lmcache_core.memory import available_memory
from lmcache_core.plugins import PluginManager

NS = KeyNamespace(model="config-hardening")
LAUGHS = (
    "\n".join(
        [
            'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
            *(f"{c}: &{c} [{','.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")),
            "tenant_salt: *i",
        ]
    )
    + "\n"
)


def write(tmp_path: Path, text: str | bytes, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


# -- sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("0.5KiB", 512), ("1.5GB", 1_500_000_000), ("0.25MiB", 2**18), ("0", 0)])
def test_fractional_sizes_that_are_whole_bytes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad, why",
    [
        ("0.5", "whole number of bytes"),
        ("1.3B", "whole number of bytes"),
        ("0.0001KB", "whole number"),
        ("9" * 400, "expected a size"),
        ("9" * 25, "larger than"),
        (10**400, "larger than"),
        ("2000000TiB", "larger than"),
    ],
)
def test_sizes_that_are_not_whole_or_too_large_are_value_errors(bad: object, why: str) -> None:
    with pytest.raises(ValueError, match=why) as err:
        parse_size(bad)
    assert err.type is ValueError and len(str(err.value)) < 300  # a 400-digit value is not echoed in full


def test_half_a_byte_in_a_file_names_key_and_file(tmp_path: Path) -> None:
    p = write(tmp_path, "backends:\n  - name: local_cpu\n    max_size: '0.5'\n")
    with pytest.raises(ConfigError, match=r"staging_size|backends") as err:
        load_config(p, env={}, overrides={"staging_size": "0.5"})
    assert "staging_size" in str(err.value) and "whole number" in str(err.value)
    p = write(tmp_path, f"staging_size: {'9' * 400}\n", "big.yaml")
    with pytest.raises(ConfigError, match=rf"staging_size: .*larger than .*\(from {p}\)"):
        load_config(p, env={})


# -- files ---------------------------------------------------------------------------------
def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    p = write(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "logo.png")
    with pytest.raises(ConfigError, match=rf"config file {p} is not UTF-8 text \(byte 0 is 0x89\)"):
        load_config(p, env={})


def test_device_directory_and_oversized_files_are_refused_quickly(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    for path in ("/dev/zero", "/dev/urandom", str(tmp_path)):
        with pytest.raises(ConfigError, match="is not a regular file"):
            load_config(path, env={})
    big = write(tmp_path, "# padding\n" * 200_000, "huge.yaml")  # 2 MB of comments
    with pytest.raises(ConfigError, match=rf"config file {big} is larger than 1024 KiB"):
        load_config(big, env={})
    assert time.perf_counter() - t0 < 2.0


def test_alias_bomb_in_a_file_or_env_var_is_refused(tmp_path: Path) -> None:
    assert len(LAUGHS.encode()) < 700
    p = write(tmp_path, LAUGHS)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"{p}: the YAML expands to more than 100000 values"):
        load_config(p, env={})
    with pytest.raises(ConfigError, match="env var LMCACHE_CORE_TENANT_SALT: the YAML expands"):
        load_config(env={"LMCACHE_CORE_TENANT_SALT": "{" + LAUGHS.replace("\n", ", ").rstrip(", ") + "}"})
    with pytest.raises(ConfigError, match="cycle|not valid YAML"):
        load_config(write(tmp_path, "tenant_salt: &x [*x]\n", "cycle.yaml"), env={})
    with pytest.raises(ConfigError, match="nested too deeply|not valid YAML"):
        load_config(write(tmp_path, "tenant_salt: " + "[" * 5_000 + "]" * 5_000 + "\n", "deep.yaml"), env={})
    assert time.perf_counter() - t0 < 10.0  # ~0.5 s on a quiet machine
    # Negative control: anchors and merge keys in a normal config still work.
    ok = write(tmp_path, "base: &cpu {name: local_cpu, max_size: 8MiB}\n", "anchors.yaml")
    text = "backends:\n  - &cpu {name: local_cpu, max_size: 8MiB}\nstaging_size: 1MiB\n"
    loaded = load_config(write(tmp_path, text, "anchors2.yaml"), env={})
    assert loaded.config.backends[0].options() == {"max_size": "8MiB"}
    with pytest.raises(ConfigError, match="base: unknown key"):  # parsed fine, then validated
        load_config(ok, env={})


CLI_PROBE = textwrap.dedent(
    """
    import contextlib, io, json, resource, sys, time
    from lmcache_core.cli import main
    # A hard bound, not just a measurement: at most 256 MiB more address space than
    # the imports took, so an expanding document fails with MemoryError here.
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
    for path in sys.argv[1:]:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        err = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["config", "--show", "-f", path])
        rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        print(json.dumps({"rc": rc, "s": time.perf_counter() - t0, "rss_mib": rss, "err": err.getvalue()}))
    """
)


def test_config_show_on_a_bomb_or_a_device_is_bounded(tmp_path: Path) -> None:
    """One fresh process shows the bomb, then /dev/zero, then a valid config (the
    control, which must succeed); peak RSS growth is measured per call."""
    paths = [str(write(tmp_path, LAUGHS)), "/dev/zero", str(write(tmp_path, "chunk_size: 128\n", "ok.yaml"))]
    proc = subprocess.run([sys.executable, "-c", CLI_PROBE, *paths], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bomb, dev, control = (json.loads(line) for line in proc.stdout.strip().splitlines()[-3:])
    print(json.dumps({"bomb": bomb, "dev_zero": dev, "control": control}, indent=1))
    assert control["rc"] == 0
    for res, what in ((bomb, "expands to more than"), (dev, "not a regular file")):
        assert res["rc"] == 2 and what in str(res["err"]), res
        assert res["s"] < 5.0 and float(res["rss_mib"]) < 64, res


# -- memory ----------------------------------------------------------------------------------
def test_cpu_tier_larger_than_available_memory_names_key_and_file(tmp_path: Path) -> None:
    avail = available_memory()
    assert avail is not None and avail > 0
    size = (avail * 2) // 2**30 + 1
    p = write(tmp_path, f"backends:\n  - name: local_cpu\n    max_size: {size}GiB\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        CacheEngine(load_config(p, env={}), namespace=NS, plugins=PluginManager(load_entry_points=False))
    msg = str(err.value)
    assert time.perf_counter() - t0 < 1.0
    assert "backends[0] (local_cpu: " in msg and "staging_size" in msg and str(p) in msg and "available" in msg, msg
    # Negative control: a pool that fits starts.
    small = write(tmp_path, "backends:\n  - name: local_cpu\n    max_size: 16MiB\nstaging_size: 1MiB\n", "small.yaml")
    with CacheEngine(load_config(small, env={}), namespace=NS, plugins=PluginManager(load_entry_points=False)) as eng:
        assert eng.pool.capacity >= 17 * 2**20
    assert MAX_SIZE_BYTES > avail


# -- peer secret -------------------------------------------------------------------------------
def test_short_peer_secret_is_refused_with_how_to_generate_one(tmp_path: Path) -> None:
    from lmcache_backend_peer.config import PeerConfig, load_secret

    from lmcache_core.config import validate_section

    for secret in ("x", "fifteen-bytes!!"):
        with pytest.raises(ConfigError, match=r"backends\[1\]: .*is \d+ bytes; it must be at least 16.*urandom"):
            validate_section(PeerConfig, {"peers": ["10.0.0.1:9000"], "secret": secret}, "backends[1]", "cfg.yaml")
    f = write(tmp_path, "short\n", "peer.secret")
    cfg = validate_section(PeerConfig, {"peers": ["10.0.0.1:9000"], "secret_file": str(f)}, "backends[1]", "cfg.yaml")
    with pytest.raises(ConfigError, match=rf"backends\[1\].secret_file: {f}: .*5 bytes.*at least 16.*\(from cfg.yaml\)"):
        load_secret(cfg, "backends[1]", "cfg.yaml")
    f.write_text("0123456789abcdef\n")  # exactly 16 bytes: accepted
    assert load_secret(cfg, "backends[1]", "cfg.yaml") == b"0123456789abcdef"
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_backend_peer.cli", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"LMCACHE_PEER_SECRET": "x", "PATH": ""},
    )
    assert proc.returncode == 2 and "at least 16" in proc.stderr, proc.stderr
