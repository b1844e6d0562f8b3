"""Configuration: a YAML file (given, or named by the environment), environment
variables and programmatic overrides, in that precedence; the embedded default (a CPU
tier only); sizes with units; and errors that say where the bad value came from (key
path and file, environment variable or override), for unknown keys, bad sizes,
unknown backends and codecs (listing what is installed, or what to install) and
unreadable or invalid files.

Hostile input ends as a clear ConfigError naming the file (or env var) and key, in
bounded time and memory: a YAML alias bomb, cyclic or deeply nested aliases, a binary
file, a device, a directory or an oversized file (``lmcache-core config --show`` on
the 605-byte bomb or ``/dev/zero`` exits 2 in < 5 s with < 64 MiB peak RSS growth,
under an address-space limit of 256 MiB above the imports, in a fresh subprocess; a
valid config shown by the same process is the control). Sizes use exact arithmetic
(fractions that are whole bytes only, nothing past the largest size); a CPU tier
larger than the machine's available memory is refused before any allocation; a peer
secret under 16 bytes is refused with how to generate one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.config import MAX_SIZE_BYTES, ConfigError, load_config, parse_size
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.memory import available_memory
from lmcache_core.plugins import PluginManager

NS = KeyNamespace(model="test-model")


def write(tmp_path: Path, text: str | bytes, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def test_yaml_file_is_read_and_sourced(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_size: 64\nserde: lz4\nbackends:\n  - name: local_cpu\n    max_size: 8MiB\n")
    loaded = load_config(p, env={})
    assert loaded.config.chunk_size == 64
    assert loaded.config.serde == "lz4"
    assert loaded.config.backends[0].options() == {"max_size": "8MiB"}
    assert loaded.source_of("chunk_size") == str(p)
    assert loaded.source_of("backends[0].max_size") == str(p)
    assert loaded.source_of("write_queue_size") == "default"


def test_config_path_from_env(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_size: 32\n")
    loaded = load_config(env={"LMCACHE_CORE_CONFIG": str(p)})
    assert loaded.config.chunk_size == 32
    assert str(p) in loaded.source_of("chunk_size")
    assert "LMCACHE_CORE_CONFIG" in loaded.source_of("chunk_size")


def test_explicit_path_beats_env_path(tmp_path: Path) -> None:
    a = write(tmp_path, "chunk_size: 32\n", "a.yaml")
    b = write(tmp_path, "chunk_size: 48\n", "b.yaml")
    assert load_config(b, env={"LMCACHE_CORE_CONFIG": str(a)}).config.chunk_size == 48


def test_precedence_file_then_env_then_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_size: 32\nwrite_queue_size: 7\nserde: raw\n")
    env = {"LMCACHE_CORE_CHUNK_SIZE": "64", "LMCACHE_CORE_SERDE": "lz4"}
    loaded = load_config(p, env=env, overrides={"chunk_size": 128})
    cfg = loaded.config
    assert (cfg.chunk_size, cfg.serde, cfg.write_queue_size) == (128, "lz4", 7)
    assert loaded.source_of("chunk_size") == "programmatic override"
    assert loaded.source_of("serde") == "env var LMCACHE_CORE_SERDE"
    assert loaded.source_of("write_queue_size") == str(p)


def test_env_override_of_structured_value() -> None:
    env = {"LMCACHE_CORE_BACKENDS": "[{name: local_cpu, max_size: 2MiB}]", "LMCACHE_CORE_TENANT_SALT": "t1"}
    cfg = load_config(env=env).config
    assert cfg.backends[0].options() == {"max_size": "2MiB"}
    assert cfg.tenant_salt == "t1"


def test_embedded_default_is_cpu_tier_only() -> None:
    loaded = load_config(env={})
    assert [b.name for b in loaded.config.backends] == ["local_cpu"]
    assert loaded.source_of("backends") == "embedded default"
    small = load_config(env={}, overrides={"backends": [{"name": "local_cpu", "max_size": "4MiB"}]})
    with CacheEngine(small, namespace=NS, plugins=PluginManager(load_entry_points=False)) as eng:
        assert [type(t) for t in eng.tiers] == [LocalCpuBackend]


@pytest.mark.parametrize(
    "text, expected",
    [
        (1024, 1024),
        ("0", 0),
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("4 KiB", 4096),
        ("10kb", 10_000),
        ("3TiB", 3 * 2**40),
        ("7b", 7),
    ],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12XB", "GiB", "-1GiB", -5, True, 1.5, "1,5GiB", None])
def test_bad_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_size_strings_reach_the_tier(tmp_path: Path) -> None:
    p = write(tmp_path, "backends:\n  - name: local_cpu\n    max_size: 3MiB\nstaging_size: 1MiB\n")
    loaded = load_config(p, env={})
    assert loaded.config.staging_size == 2**20
    with CacheEngine(loaded, namespace=NS, plugins=PluginManager(load_entry_points=False)) as eng:
        assert eng.tiers[0].max_size == 3 * 2**20


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_sise: 64\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p, env={})
    assert "chunk_sise: unknown key" in str(exc.value)
    assert str(p) in str(exc.value)


def test_bad_value_from_env_names_env_var() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(env={"LMCACHE_CORE_CHUNK_SIZE": "many"})
    assert "chunk_size" in str(exc.value) and "env var LMCACHE_CORE_CHUNK_SIZE" in str(exc.value)


def test_bad_value_from_override_names_override() -> None:
    with pytest.raises(ConfigError, match=r"write_queue_size: .*programmatic override"):
        load_config(env={}, overrides={"write_queue_size": 0})


def test_unknown_env_setting_is_an_error() -> None:
    with pytest.raises(ConfigError, match="LMCACHE_CORE_CHUNKSIZE: unknown setting"):
        load_config(env={"LMCACHE_CORE_CHUNKSIZE": "64"})


def test_bad_top_level_size_names_key_and_file(tmp_path: Path) -> None:
    p = write(tmp_path, "staging_size: 12 parsecs\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p, env={})
    assert "staging_size" in str(exc.value) and str(p) in str(exc.value)


def test_bad_backend_size_names_key_path_and_file(tmp_path: Path) -> None:
    p = write(tmp_path, "backends:\n  - name: local_cpu\n    max_size: lots\n")
    loaded = load_config(p, env={})
    with pytest.raises(ConfigError) as exc:
        CacheEngine(loaded, namespace=NS, plugins=PluginManager(load_entry_points=False))
    assert "backends[0].max_size" in str(exc.value) and str(p) in str(exc.value)


def test_unknown_backend_key_names_key_path(tmp_path: Path) -> None:
    p = write(tmp_path, "backends:\n  - name: local_cpu\n    max_sise: 1MiB\n")
    with pytest.raises(ConfigError, match=r"backends\[0\]\.max_sise: unknown key"):
        CacheEngine(load_config(p, env={}), namespace=NS, plugins=PluginManager(load_entry_points=False))


def test_unknown_backend_lists_installed(tmp_path: Path) -> None:
    p = write(tmp_path, "backends:\n  - name: local_cpu\n    max_size: 1MiB\n  - name: nvme_magic\n")
    with pytest.raises(ConfigError) as exc:
        CacheEngine(load_config(p, env={}), namespace=NS, plugins=PluginManager(load_entry_points=False))
    msg = str(exc.value)
    assert "backends[1].name: unknown backend 'nvme_magic'" in msg
    assert "installed backends: local_cpu" in msg and str(p) in msg


@pytest.mark.parametrize("name", ["disk", "s3", "peer"])
def test_known_but_missing_backend_says_what_to_install(name: str) -> None:
    loaded = load_config(env={}, overrides={"backends": [{"name": name}]})
    with pytest.raises(ConfigError) as exc:
        CacheEngine(loaded, namespace=NS, plugins=PluginManager(load_entry_points=False))
    assert f"pip install 'lmcache-core[{name}]'" in str(exc.value)


def test_unknown_codec_lists_installed() -> None:
    loaded = load_config(env={"LMCACHE_CORE_SERDE": "zstd"}, overrides={"backends": [{"name": "local_cpu", "max_size": "1MiB"}]})
    with pytest.raises(
        ConfigError, match=r"serde: unknown codec 'zstd' \(from env var LMCACHE_CORE_SERDE\); installed codecs: fp8, lz4, raw"
    ):
        CacheEngine(loaded, namespace=NS, plugins=PluginManager(load_entry_points=False))


def test_unreadable_or_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(tmp_path / "nope.yaml", env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "chunk_size: [1\n"), env={})
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n", "list.yaml"), env={})


# -- hostile files and values: refused in bounded time and memory ------------------------


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
