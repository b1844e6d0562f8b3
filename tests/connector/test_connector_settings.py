"""The connector's keys live in one section, ``connector:``
(:mod:`lmcache_connector.settings`, registered with the core). Each of its keys merges on
its own across the sources (file, env vars ``LMCACHE_CORE_CONNECTOR_<KEY>``,
overrides such as vLLM's ``kv_connector_extra_config``) and keeps its own source.
The old top-level spellings (``save_unfull_chunk: true``) still work for one release:
moved to ``connector.<key>`` with exactly one ``DeprecationWarning`` and a log warning
naming the new path; both spellings from one source are a ``ConfigError`` naming both.
(The connector-only keys of ``kv_connector_extra_config``, ``async_loads`` and the
rest, are tested with the connector's options in tests/connector.)"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from lmcache_connector.settings import ConnectorConfig, ConnectorSection
from lmcache_core import cli
from lmcache_core.config import ConfigError, LoadedConfig, moved_keys, renamed_keys
from lmcache_core.config import load_config as core_load_config

EXTRA = "kv_connector_extra_config"


def load_config(*args: Any, **kw: Any) -> LoadedConfig:
    """The config as the connector loads it (its section registered)."""
    return core_load_config(*args, model=ConnectorConfig, **kw)


#: every key that moved, a value other than its default, and the YAML for it
MOVED = {
    "save_unfull_chunk": (True, "true"),
    "save_decode_cache": (True, "true"),
    "sub_chunk_hits": (False, "false"),
    "priority_limit": (3, "3"),
    "layout": ("block", "block"),
    "lookup_timeout_s": (0.5, "0.5"),
    "load_policy": ("faster_than_recompute", "faster_than_recompute"),
    "load_margin": (0.3, "0.3"),
}


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def deprecations(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]


def load_quietly(*args: Any, **kw: Any) -> Any:
    """Load, failing on any deprecation warning (the new spelling warns about nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return load_config(*args, **kw)


def test_the_section_holds_the_connector_keys_with_their_defaults() -> None:
    c = ConnectorConfig().connector
    assert (c.save_unfull_chunk, c.save_decode_cache, c.sub_chunk_hits, c.priority_limit) == (False, False, True, None)
    assert (c.layout, c.lookup_timeout_s, c.load_policy, c.load_margin) == ("auto", 2.0, "always", 0.2)
    assert (c.model_id, c.async_saves, c.async_loads, c.layerwise) == (None, "auto", "auto", False)
    for key in MOVED:  # none of them is a top-level key any more
        assert key not in ConnectorConfig.model_fields and key in ConnectorSection.model_fields
    for key in ("tenant_salt", "verify_fraction", "quarantine_dir", "background_nice", "staging_size"):
        assert key in ConnectorConfig.model_fields and key not in ConnectorSection.model_fields  # core features stay


def test_new_spelling_from_a_file(tmp_path: Path) -> None:
    p = write(tmp_path, "connector:\n" + "".join(f"  {k}: {y}\n" for k, (_v, y) in MOVED.items()) + "  async_loads: true\n")
    loaded = load_quietly(p, env={})
    for key, (value, _yaml) in MOVED.items():
        assert getattr(loaded.config.connector, key) == value
        assert loaded.source_of(f"connector.{key}") == str(p)
    assert loaded.config.connector.async_loads is True
    assert loaded.source_of("connector.model_id") == "default"  # not set: its own source, not the file's


def test_new_spelling_from_env_vars() -> None:
    env = {"LMCACHE_CORE_CONNECTOR_ASYNC_LOADS": "true", "LMCACHE_CORE_CONNECTOR_LOAD_MARGIN": "0.5"}
    loaded = load_quietly(None, env=env)
    assert loaded.config.connector.async_loads is True and loaded.config.connector.load_margin == 0.5
    assert loaded.source_of("connector.async_loads") == "env var LMCACHE_CORE_CONNECTOR_ASYNC_LOADS"
    assert loaded.source_of("connector.load_margin") == "env var LMCACHE_CORE_CONNECTOR_LOAD_MARGIN"
    # the whole section as one YAML mapping, next to a key of it from its own variable
    env = {"LMCACHE_CORE_CONNECTOR": "{layout: block, layerwise: true}", "LMCACHE_CORE_CONNECTOR_MODEL_ID": "m"}
    loaded = load_quietly(None, env=env)
    c = loaded.config.connector
    assert (c.layout, c.layerwise, c.model_id) == ("block", True, "m")
    assert loaded.source_of("connector.layout") == "env var LMCACHE_CORE_CONNECTOR"
    assert loaded.source_of("connector.model_id") == "env var LMCACHE_CORE_CONNECTOR_MODEL_ID"


def test_new_spelling_from_overrides() -> None:
    loaded = load_quietly(None, env={}, overrides={"connector": {"priority_limit": 0}}, overrides_source=EXTRA)
    assert loaded.config.connector.priority_limit == 0
    assert loaded.source_of("connector.priority_limit") == EXTRA
    assert ConnectorConfig(connector={"layerwise": True}).connector.layerwise is True  # type: ignore[arg-type]


def _old_spelling(tmp_path: Path, where: str, key: str, yaml_value: str) -> tuple[Any, str]:
    """Load ``key`` at the top level from one source; its source as named."""
    if where == "file":
        p = write(tmp_path, f"{key}: {yaml_value}\n")
        return load_config(p, env={}), str(p)
    if where == "env":
        name = f"LMCACHE_CORE_{key.upper()}"
        return load_config(None, env={name: yaml_value}), f"env var {name}"
    import yaml

    return load_config(None, env={}, overrides={key: yaml.safe_load(yaml_value)}, overrides_source=EXTRA), EXTRA


@pytest.mark.parametrize("where", ["file", "env", "override"])
@pytest.mark.parametrize("key", list(MOVED))
def test_old_spelling_moves_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str, key: str) -> None:
    value, yaml_value = MOVED[key]
    with caplog.at_level(logging.WARNING, logger="lmcache_core.config"):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            loaded, src = _old_spelling(tmp_path, where, key, yaml_value)
    assert deprecations(record) == [f"{key} (from {src}) is deprecated: use connector.{key}"]
    assert f"{key} (from {src}) is deprecated: use connector.{key}" in caplog.text
    assert getattr(loaded.config.connector, key) == value
    assert getattr(ConnectorSection(), key) != value  # the value is the one given, not the default
    assert loaded.source_of(f"connector.{key}") == src


def test_old_millisecond_spelling_moves_then_converts(tmp_path: Path) -> None:
    p = write(tmp_path, "lookup_timeout_ms: 1500\n")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = load_config(p, env={})
    assert deprecations(record) == [
        f"lookup_timeout_ms (from {p}) is deprecated: use connector.lookup_timeout_ms",
        f"connector.lookup_timeout_ms (from {p}) is deprecated: use lookup_timeout_s: 1.5 (seconds)",
    ]
    assert loaded.config.connector.lookup_timeout_s == 1.5
    assert loaded.source_of("connector.lookup_timeout_s") == str(p)
    with pytest.warns(DeprecationWarning, match="LMCACHE_CORE_LOOKUP_TIMEOUT_MS"):
        loaded = load_config(None, env={"LMCACHE_CORE_LOOKUP_TIMEOUT_MS": "300"})
    assert loaded.config.connector.lookup_timeout_s == 0.3
    assert loaded.source_of("connector.lookup_timeout_s") == "env var LMCACHE_CORE_LOOKUP_TIMEOUT_MS"
    with pytest.warns(DeprecationWarning):
        assert ConnectorConfig(lookup_timeout_ms=40).connector.lookup_timeout_s == 0.04  # type: ignore[call-arg]


def test_old_spelling_on_a_model_built_directly() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = ConnectorConfig(save_unfull_chunk=True, connector={"layerwise": True})  # type: ignore[call-arg, arg-type]
    assert deprecations(record) == ["save_unfull_chunk is deprecated: use connector.save_unfull_chunk"]
    assert cfg.connector.save_unfull_chunk and cfg.connector.layerwise


def test_both_spellings_from_one_source_are_an_error(tmp_path: Path) -> None:
    p = write(tmp_path, "save_unfull_chunk: true\nconnector:\n  save_unfull_chunk: false\n")
    both = r"save_unfull_chunk: both save_unfull_chunk \(deprecated\) and connector\.save_unfull_chunk are set"
    with pytest.raises(ConfigError, match=both + rf".*\(from {re.escape(str(p))}\)"):
        load_config(p, env={})
    env = {"LMCACHE_CORE_LOAD_POLICY": "always", "LMCACHE_CORE_CONNECTOR_LOAD_POLICY": "always"}
    with pytest.raises(
        ConfigError, match=r"load_policy: both .*connector\.load_policy.*\(from env var LMCACHE_CORE_LOAD_POLICY\)"
    ):
        load_config(None, env=env)
    with pytest.raises(ConfigError, match=r"layout: both layout \(deprecated\) and connector\.layout .*\(from " + EXTRA):
        load_config(None, env={}, overrides={"layout": "block", "connector": {"layout": "token"}}, overrides_source=EXTRA)
    # the same key from the section's mapping and its own variable
    env = {"LMCACHE_CORE_CONNECTOR": "{layout: block}", "LMCACHE_CORE_CONNECTOR_LAYOUT": "token"}
    with pytest.raises(ConfigError, match="connector.layout: set by both env var LMCACHE_CORE_CONNECTOR and env var"):
        load_config(None, env=env)


def test_spellings_from_different_sources_layer(tmp_path: Path) -> None:
    """Negative control for the error above: one spelling per source is no conflict;
    the later source wins whichever spelling it uses."""
    p = write(tmp_path, "connector:\n  save_unfull_chunk: false\n")
    with pytest.warns(DeprecationWarning):
        loaded = load_config(p, env={"LMCACHE_CORE_SAVE_UNFULL_CHUNK": "true"})
    assert loaded.config.connector.save_unfull_chunk is True
    assert loaded.source_of("connector.save_unfull_chunk") == "env var LMCACHE_CORE_SAVE_UNFULL_CHUNK"
    p = write(tmp_path, "save_unfull_chunk: true\n")
    with pytest.warns(DeprecationWarning):
        loaded = load_config(p, env={}, overrides={"connector": {"save_unfull_chunk": False}})
    assert loaded.config.connector.save_unfull_chunk is False


def test_layers_merge_key_by_key(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_size: 64\nconnector:\n  save_unfull_chunk: true\n  load_policy: faster_than_recompute\n")
    loaded = load_quietly(
        p,
        env={"LMCACHE_CORE_CONNECTOR_LOAD_MARGIN": "0.4"},
        overrides={"connector": {"async_loads": True}},
        overrides_source=EXTRA,
    )
    c = loaded.config.connector
    assert c.async_loads is True
    assert c.save_unfull_chunk is True and c.load_policy == "faster_than_recompute"  # the file's, kept
    assert c.load_margin == 0.4
    assert loaded.source_of("connector.async_loads") == EXTRA
    assert loaded.source_of("connector.save_unfull_chunk") == str(p)
    assert loaded.source_of("connector.load_margin") == "env var LMCACHE_CORE_CONNECTOR_LOAD_MARGIN"
    assert loaded.source_of("connector.layerwise") == "default"
    assert loaded.source_of("connector") == ", ".join(sorted({str(p), EXTRA, "env var LMCACHE_CORE_CONNECTOR_LOAD_MARGIN"}))
    # negative control: a later source's key of the same name does replace the file's
    loaded = load_quietly(p, env={}, overrides={"connector": {"load_policy": "always"}})
    assert loaded.config.connector.load_policy == "always" and loaded.config.connector.save_unfull_chunk is True


@pytest.mark.parametrize(
    ("key", "yaml_value", "why"),
    [
        ("async_loads", "1", "must be true, false or auto, got 1"),
        ("async_saves", "'yes'", "must be true, false or auto, got 'yes'"),
        ("layout", "tokens", "'auto', 'block' or 'token'"),
        ("load_margin", "1.5", "less than 1"),
        ("lookup_timeout_s", "0", "from 0.001 to 600"),
        ("model_id", "7", "valid string"),
    ],
)
def test_a_bad_value_names_its_path_and_source(tmp_path: Path, key: str, yaml_value: str, why: str) -> None:
    p = write(tmp_path, f"chunk_size: 64\nconnector:\n  {key}: {yaml_value}\n")
    with pytest.raises(ConfigError, match=rf"connector\.{key}: .*{re.escape(why)}.*\(from {re.escape(str(p))}\)"):
        load_config(p, env={})
    name = f"LMCACHE_CORE_CONNECTOR_{key.upper()}"
    with pytest.raises(ConfigError, match=rf"connector\.{key}: .*\(from env var {name}\)"):
        load_config(p, env={name: yaml_value})
    import yaml

    value = yaml.safe_load(yaml_value)
    with pytest.raises(ConfigError, match=rf"connector\.{key}: .*\(from {EXTRA}\)"):
        load_config(p, env={}, overrides={"connector": {key: value}}, overrides_source=EXTRA)
    # and under its old spelling, where it had one: checked at its new path
    if key in MOVED:
        with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match=rf"connector\.{key}: .*\(from {EXTRA}\)"):
            load_config(p, env={}, overrides={key: value}, overrides_source=EXTRA)


def test_unknown_keys_and_wrong_shapes(tmp_path: Path) -> None:
    p = write(tmp_path, "connector:\n  save_unfull_chunks: true\n")
    with pytest.raises(ConfigError, match=rf"connector\.save_unfull_chunks: unknown key \(from {re.escape(str(p))}\)"):
        load_config(p, env={})
    with pytest.raises(ConfigError, match=r"connector\.tenant_salt: unknown key"):  # a core key, not the connector's
        load_config(None, env={}, overrides={"connector": {"tenant_salt": "x"}})
    with pytest.raises(ConfigError, match=r"connector: Input should be a valid dictionary.*\(from " + EXTRA):
        load_config(None, env={}, overrides={"connector": [1]}, overrides_source=EXTRA)
    with pytest.raises(ConfigError, match="async_loads: unknown key"):  # never a top-level core key
        load_config(write(tmp_path, "async_loads: true\n"), env={})
    with pytest.raises(ConfigError, match=r"save_unfull_chunk: moved to connector\.save_unfull_chunk, but connector is 5"):
        load_config(write(tmp_path, "save_unfull_chunk: true\nconnector: 5\n"), env={})


def test_unknown_env_vars_are_helpful() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, env={"LMCACHE_CORE_CONNECTOR_ASYNC_LOAD": "true"})
    msg = str(err.value)
    assert msg.startswith("LMCACHE_CORE_CONNECTOR_ASYNC_LOAD: unknown setting 'connector_async_load'")
    assert "did you mean LMCACHE_CORE_CONNECTOR_ASYNC_LOADS?" in msg
    assert "LMCACHE_CORE_CONNECTOR_<KEY> for connector.<key>" in msg
    assert "LMCACHE_CORE_CHUNK_SIZE" in msg and "LMCACHE_CORE_CONNECTOR_LAYOUT" in msg
    assert "LMCACHE_CORE_LAYOUT," not in msg  # deprecated names are accepted, not advertised
    with pytest.raises(ConfigError, match="LMCACHE_CORE_ASYNC_LOADS: unknown setting"):  # never a core env var
        load_config(None, env={"LMCACHE_CORE_ASYNC_LOADS": "true"})
    with pytest.raises(ConfigError, match="LMCACHE_CORE_CONNECTOR: expected a YAML mapping"):
        load_config(None, env={"LMCACHE_CORE_CONNECTOR": "true"})


@pytest.mark.parametrize("helper", [moved_keys, renamed_keys])
def test_helpers_leave_data_without_old_keys_alone(helper: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert helper("not a mapping", {"a": "sec.a"}) == "not a mapping"
        data = {"b": 1, "sec": {"a": 2}}
        assert helper(data, {"a": "sec.a"}) is data


def test_moved_keys_helper() -> None:
    moves = {"a": "sec.a"}
    with pytest.warns(DeprecationWarning, match=r"^x\.a \(from f\.yaml\) is deprecated: use x\.sec\.a$"):
        out = moved_keys({"a": 1, "sec": {"c": 2}}, moves, "x", lambda _p: "f.yaml")
    assert out == {"sec": {"c": 2, "a": 1}}
    with pytest.raises(
        ConfigError, match=r"^x\.a: both x\.a \(deprecated\) and x\.sec\.a are set; give only x\.sec\.a \(from f\.yaml\)$"
    ):
        moved_keys({"a": 1, "sec": {"a": 2}}, moves, "x", lambda _p: "f.yaml")


def test_cli_shows_each_connector_key_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    p = write(tmp_path, "connector:\n  layout: block\n")
    monkeypatch.setenv("LMCACHE_CORE_CONNECTOR_ASYNC_LOADS", "true")
    assert cli.main(["config", "--show", "-f", str(p)]) == 0
    out = capsys.readouterr().out
    assert "connector:\n  # from default\n  model_id: null\n" in out
    assert "  # from env var LMCACHE_CORE_CONNECTOR_ASYNC_LOADS\n  async_loads: true\n" in out
    assert f"  # from {p}\n  layout: block\n" in out


def test_the_installed_connector_registers_its_section() -> None:
    """What every lmcache-core command loads where the connector is installed has
    exactly the connector's own config model's keys (the two cannot drift)."""
    from lmcache_core.plugins import PluginManager

    pm = PluginManager(env={})
    info = pm.config_sections()["connector"]
    assert info.load_model() is ConnectorSection and info.origin.distribution == "lmcache-connector-vllm"
    model = pm.config_model()
    assert model.model_fields.keys() == ConnectorConfig.model_fields.keys() and model.moved_keys == ConnectorConfig.moved_keys
    assert model.model_fields["connector"].description == ConnectorConfig.model_fields["connector"].description
