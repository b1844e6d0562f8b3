"""Duration keys are seconds (``*_s``). The old millisecond spellings (``*_ms``) still
work for one release: the value is converted, with a ``DeprecationWarning`` and a log
warning naming the old key, the new key and the converted value. Both spellings from
one source, or an old value that is not a number, is a ``ConfigError`` naming the key
path and its source. A key that was never renamed warns about nothing. (The
connector's keys moved into ``connector:``; the moves are tested in
tests/connector/test_connector_settings.py.)"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from lmcache_connector.settings import ConnectorConfig
from lmcache_core.config import ConfigError, LoadedConfig, ms_to_seconds, renamed_keys
from lmcache_core.config import load_config as core_load_config


def load_config(*args: Any, **kw: Any) -> LoadedConfig:
    """The config with the connector's section, as the connector (and, where it is
    installed, every lmcache-core command) loads it."""
    return core_load_config(*args, model=ConnectorConfig, **kw)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_new_key_is_seconds_and_does_not_warn(tmp_path: Path) -> None:
    p = write(tmp_path, "connector:\n  lookup_timeout_s: 0.25\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        loaded = load_config(p, env={})
    assert loaded.config.connector.lookup_timeout_s == 0.25
    assert loaded.source_of("connector.lookup_timeout_s") == str(p)
    assert ConnectorConfig().connector.lookup_timeout_s == 2.0  # the default: 2000 ms before


def test_old_key_gives_the_same_value_and_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    new = load_config(write(tmp_path, "connector:\n  lookup_timeout_s: 1.5\n"), env={}).config
    p = write(tmp_path, "connector:\n  lookup_timeout_ms: 1500\n")
    with caplog.at_level(logging.WARNING, logger="lmcache_core.config"):
        with pytest.warns(
            DeprecationWarning, match=r"connector\.lookup_timeout_ms .*is deprecated: use lookup_timeout_s: 1\.5 \(seconds\)"
        ):
            loaded = load_config(p, env={})
    assert loaded.config == new
    assert loaded.config.connector.lookup_timeout_s == 1.5
    assert loaded.source_of("connector.lookup_timeout_s") == str(p)  # the source follows the value to its new name
    assert f"connector.lookup_timeout_ms (from {p}) is deprecated: use lookup_timeout_s: 1.5 (seconds)" in caplog.text


def test_old_key_from_env_and_overrides_is_converted() -> None:
    with pytest.warns(DeprecationWarning, match="LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_MS"):
        loaded = load_config(None, env={"LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_MS": "300"})
    assert loaded.config.connector.lookup_timeout_s == 0.3
    assert loaded.source_of("connector.lookup_timeout_s") == "env var LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_MS"
    with pytest.warns(DeprecationWarning, match="kv_connector_extra_config"):
        loaded = load_config(
            None,
            env={},
            overrides={"connector": {"lookup_timeout_ms": 2000}},
            overrides_source="kv_connector_extra_config",
        )
    assert loaded.config.connector.lookup_timeout_s == 2.0
    with pytest.warns(DeprecationWarning):
        assert ConnectorConfig(connector={"lookup_timeout_ms": 40}).connector.lookup_timeout_s == 0.04  # type: ignore[arg-type]


def test_both_spellings_from_one_source_are_an_error(tmp_path: Path) -> None:
    p = write(tmp_path, "connector:\n  lookup_timeout_ms: 1500\n  lookup_timeout_s: 2\n")
    with pytest.raises(
        ConfigError, match=r"connector\.lookup_timeout_ms: both lookup_timeout_ms .* and lookup_timeout_s .*are set"
    ) as err:
        load_config(p, env={})
    assert f"(from {p})" in str(err.value)
    env = {"LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_MS": "100", "LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_S": "0.1"}
    with pytest.raises(ConfigError, match=r"lookup_timeout_ms: both .*\(from env var LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_MS\)"):
        load_config(None, env=env)
    with pytest.raises(ConfigError, match="both"):
        load_config(None, env={}, overrides={"connector": {"lookup_timeout_ms": 100, "lookup_timeout_s": 0.1}})


def test_a_later_source_replaces_either_spelling(tmp_path: Path) -> None:
    p = write(tmp_path, "connector:\n  lookup_timeout_ms: 1500\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the file's old key is replaced, never read
        loaded = load_config(p, env={"LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_S": "0.5"})
    assert loaded.config.connector.lookup_timeout_s == 0.5
    assert loaded.source_of("connector.lookup_timeout_s") == "env var LMCACHE_CORE_CONNECTOR_LOOKUP_TIMEOUT_S"
    p = write(tmp_path, "connector:\n  lookup_timeout_s: 3\n")
    with pytest.warns(DeprecationWarning):
        loaded = load_config(p, env={}, overrides={"connector": {"lookup_timeout_ms": 250}})
    assert loaded.config.connector.lookup_timeout_s == 0.25


@pytest.mark.parametrize("value", ["'2000'", "fast", "true", "null", "[1]"])
def test_old_value_that_is_not_a_number_is_an_error(tmp_path: Path, value: str) -> None:
    p = write(tmp_path, f"connector:\n  lookup_timeout_ms: {value}\n")
    with pytest.raises(
        ConfigError,
        match=rf"connector\.lookup_timeout_ms: expected a number of milliseconds, got .* \(from {re.escape(str(p))}\); "
        r".*give lookup_timeout_s in seconds",
    ):
        load_config(p, env={})


def test_old_value_is_checked_against_the_new_bounds(tmp_path: Path) -> None:
    p = write(tmp_path, "connector:\n  lookup_timeout_ms: 0\n")
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            ConfigError,
            match=rf"connector\.lookup_timeout_s: .*seconds from 0\.001 to 600 .*got 0\.0 \(from {re.escape(str(p))}\)",
        ),
    ):
        load_config(p, env={})
    with pytest.raises(ConfigError, match="too large"):
        load_config(write(tmp_path, f"connector:\n  lookup_timeout_ms: {10**400}\n"), env={})
    with pytest.raises(ConfigError, match="lookup_timeout_s"):
        load_config(write(tmp_path, "connector:\n  lookup_timeout_s: .inf\n"), env={})


def test_keys_never_renamed_do_not_warn(tmp_path: Path) -> None:
    """Negative control: other keys, including ones already in seconds, load without a
    deprecation warning, and the old spelling of a key that never existed is still an
    unknown key."""
    p = write(tmp_path, "chunk_size: 64\nverify_window_s: 60\nwrite_queue_size: 8\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        loaded = load_config(p, env={})
        load_config(None, env={})
    assert loaded.config.verify_window_s == 60.0
    with pytest.raises(ConfigError, match="verify_window_ms: unknown key"):
        load_config(write(tmp_path, "verify_window_ms: 60000\n"), env={})
    with pytest.raises(ConfigError, match="unknown setting 'verify_window_ms'"):
        load_config(None, env={"LMCACHE_CORE_VERIFY_WINDOW_MS": "60000"})


def test_helper_names_the_section_path() -> None:
    renames = {"timeout_ms": "timeout_s"}
    assert renamed_keys("not a mapping", renames) == "not a mapping"
    assert renamed_keys({"timeout_s": 1}, renames) == {"timeout_s": 1}
    with pytest.warns(
        DeprecationWarning, match=r"backends\[2\]\.timeout_ms \(from x\.yaml\) is deprecated: use timeout_s: 0\.75"
    ):
        out = renamed_keys({"timeout_ms": 750, "other": 1}, renames, "backends[2]", lambda _p: "x.yaml")
    assert out == {"timeout_s": 0.75, "other": 1}
    with pytest.raises(ConfigError, match=r"^backends\[2\]\.timeout_ms: both .* \(from x\.yaml\)$"):
        renamed_keys({"timeout_ms": 1, "timeout_s": 1}, renames, "backends[2]", lambda _p: "x.yaml")


def test_one_rule_for_config_keys_and_flags() -> None:
    """``ms_to_seconds`` is the rule both the config (``renamed_keys``) and the peer
    node's ``--*-ms`` flags use: the same checks, the same wording."""
    with pytest.warns(DeprecationWarning, match=r"^--t-ms is deprecated: use --t-s 0\.25 \(seconds\)$"):
        assert ms_to_seconds(250, "--t-ms", "--t-s", sep=" ", say=lambda _msg: None) == 0.25
    with pytest.raises(ConfigError, match=r"^--t-ms: both --t-ms \(deprecated, milliseconds\) and --t-s \(seconds\) are set"):
        ms_to_seconds(250, "--t-ms", "--t-s", both=True)
    with pytest.raises(ConfigError, match="expected a number of milliseconds"):
        ms_to_seconds(True, "t_ms", "t_s")
