"""Configuration: a YAML file (given, or named by the environment), environment
variables and programmatic overrides, in that precedence; the embedded default (a CPU
tier only); sizes with units; and errors that say where the bad value came from (key
path and file, environment variable or override), for unknown keys, bad sizes,
unknown backends and codecs (listing what is installed, or what to install) and
unreadable or invalid files."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.config import ConfigError, load_config, parse_size
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.plugins import PluginManager

NS = KeyNamespace(model="test-model")


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
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
