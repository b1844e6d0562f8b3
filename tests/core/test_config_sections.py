"""Plugins add top-level config sections (``register_config_sections``): the core
validates them with the plugin's model, merges their keys one by one across sources
and shows them, and knows nothing else about them. A section of a first-party plugin
that is not installed (``connector:`` without the vLLM connector) is an error that
says what to install; any other unknown section is an unknown key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from lmcache_core import cli
from lmcache_core.config import ConfigError, CoreConfig, Flag, StrictModel, config_model, load_config
from lmcache_core.hookspecs import RegisterConfigSection, hookimpl
from lmcache_core.plugins import PluginError, PluginManager


class ProbeSection(StrictModel):
    enabled: Flag = Field(False, description="probe on")
    depth: int = Field(3, ge=1, description="how deep")
    renamed_ms_keys = {"delay_ms": "delay_s"}
    delay_s: float = Field(0.5, description="delay in seconds")
    moved_from_top = ("depth",)


class ProbePlugin:
    @hookimpl
    def register_config_sections(self, register: RegisterConfigSection) -> None:
        register("probe", ProbeSection, description="a test plugin's section")


def manager() -> PluginManager:
    pm = PluginManager(load_entry_points=False, env={})
    pm.register(ProbePlugin(), name="probe")
    return pm


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_a_registered_section_is_validated_and_merged_key_by_key(tmp_path: Path) -> None:
    model = manager().config_model()
    assert issubclass(model, CoreConfig) and model.model_fields["probe"].annotation is ProbeSection
    p = write(tmp_path, "probe:\n  enabled: true\n  depth: 5\n")
    loaded = load_config(p, env={"LMCACHE_CORE_PROBE_DEPTH": "7"}, overrides={"probe": {"delay_ms": 250}}, model=model)
    probe = loaded.config.probe  # type: ignore[attr-defined]
    assert (probe.enabled, probe.depth, probe.delay_s) == (True, 7, 0.25)
    assert loaded.source_of("probe.enabled") == str(p)
    assert loaded.source_of("probe.depth") == "env var LMCACHE_CORE_PROBE_DEPTH"
    with pytest.raises(ConfigError, match=r"probe\.depth: .*greater than or equal to 1.*cfg\.yaml"):
        load_config(write(tmp_path, "probe:\n  depth: 0\n"), env={}, model=model)
    with pytest.warns(DeprecationWarning, match="use probe.depth"):
        assert load_config(write(tmp_path, "depth: 4\n"), env={}, model=model).config.probe.depth == 4  # type: ignore[attr-defined]


def test_the_same_sections_give_the_same_model() -> None:
    assert manager().config_model() is manager().config_model()
    assert config_model({}) is CoreConfig


def test_without_the_plugin_its_section_is_an_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"probe: unknown key"):
        load_config(write(tmp_path, "probe:\n  enabled: true\n"), env={})
    with pytest.raises(ConfigError, match="LMCACHE_CORE_PROBE_DEPTH: unknown setting"):
        load_config(None, env={"LMCACHE_CORE_PROBE_DEPTH": "7"})


def test_a_known_plugins_section_without_the_plugin_says_what_to_install(tmp_path: Path) -> None:
    p = write(tmp_path, "chunk_size: 256\nconnector:\n  async_loads: true\n")
    with pytest.raises(ConfigError, match=r"connector: .*not installed.*cfg\.yaml.*pip install 'lmcache-core\[vllm\]'"):
        load_config(p, env={})
    with pytest.raises(ConfigError, match=r"LMCACHE_CORE_CONNECTOR_ASYNC_LOADS: .*pip install 'lmcache-core\[vllm\]'"):
        load_config(None, env={"LMCACHE_CORE_CONNECTOR_ASYNC_LOADS": "true"})


def test_a_section_registered_by_dotted_path_is_imported_when_a_config_needs_it() -> None:
    class Lazy:
        @hookimpl
        def register_config_sections(self, register: RegisterConfigSection) -> None:
            register("probe", f"{__name__}:ProbeSection")
            register("gone", f"{__name__}:NoSuchSection")

    pm = PluginManager(load_entry_points=False, env={})
    pm.register(Lazy(), name="lazy")
    assert pm.config_sections()["probe"].model == f"{__name__}:ProbeSection"
    assert pm.config_sections()["probe"].load_model() is ProbeSection
    with pytest.raises(PluginError, match="config section 'gone' .* failed to load: AttributeError"):
        pm.config_model()


@pytest.mark.parametrize("name", ["chunk_size", "two_words", "9lives"])
def test_a_section_name_must_be_a_new_word(name: str) -> None:
    class Bad:
        @hookimpl
        def register_config_sections(self, register: RegisterConfigSection) -> None:
            register(name, ProbeSection)

    pm = PluginManager(load_entry_points=False, env={})
    pm.register(Bad(), name="bad")
    assert pm.config_sections() == {} and any(name in e for e in pm.load_errors)


def test_cli_config_shows_a_plugins_section_with_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, "probe:\n  depth: 5\n")
    assert cli.main(["config", "--show", "-f", str(p)], plugin_manager=manager()) == 0
    out = capsys.readouterr().out
    assert "probe:\n  # from default\n  enabled: false\n" in out and f"  # from {p}\n  depth: 5\n" in out
