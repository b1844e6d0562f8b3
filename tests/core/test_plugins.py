"""Plugins from entry points: loaded lazily, a broken distribution isolated (and named
when its backend is asked for), plugins blocked by environment variable, misspelled
hooks reported clearly, a failing hook that does not stop the others, a factory that
must return a backend; and the example third-party distribution used through YAML
and the conformance suite."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

import pytest
import torch

from lmcache_core import CacheEngine, KeyNamespace
from lmcache_core.backend import BackendContext, StorageBackend
from lmcache_core.config import ConfigError, load_config
from lmcache_core.hookspecs import hookimpl
from lmcache_core.plugins import PluginError, PluginManager
from lmcache_core.testing import make_context
from lmcache_core.testing.tokens import retrieve_tokens, store_tokens, token_hashes

from .helpers import BROKEN_PLUGIN_SRC, GOOD_PLUGIN_SRC, make_distribution

NS = KeyNamespace(model="plugin-test")


@pytest.fixture
def dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Two real installed distributions on sys.path: one broken, one good. Module
    names are unique per test so nothing is cached in sys.modules between tests."""
    tag = uuid.uuid4().hex[:8]
    names = {"broken_mod": f"broken_plugin_{tag}", "good_mod": f"good_plugin_{tag}", "good_backend": f"good_{tag}"}
    make_distribution(tmp_path, "broken-plugin", "1.0", {"broken": names["broken_mod"]}, {names["broken_mod"]: BROKEN_PLUGIN_SRC})
    make_distribution(
        tmp_path,
        "Good_Plugin",
        "2.3",
        {"good": names["good_mod"]},
        {names["good_mod"]: GOOD_PLUGIN_SRC.format(backend=names["good_backend"])},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    names["imports_log"] = str(tmp_path / f"{names['broken_mod']}.imports")
    return names


def test_entry_points_load_lazily_and_a_broken_one_is_isolated(dists: dict[str, str]) -> None:
    pm = PluginManager()
    assert dists["good_mod"] not in sys.modules, "entry points must not load at construction"
    backends = pm.backends()
    assert dists["good_backend"] in backends and "local_cpu" in backends and "example_dict" in backends
    origin = backends[dists["good_backend"]].origin
    assert (origin.distribution, origin.version) == ("Good_Plugin", "2.3")
    assert len(pm.load_errors) == 1
    err = pm.load_errors[0]
    assert "'broken'" in err and "broken-plugin 1.0" in err and "broken on purpose" in err
    pm.codecs()
    pm.backends()
    assert Path(dists["imports_log"]).read_text().count("import") == 1, "one try per entry point"


def test_unknown_backend_error_mentions_failed_plugins(dists: dict[str, str]) -> None:
    pm = PluginManager()
    loaded = load_config(env={}, overrides={"backends": [{"name": "broken"}]})
    with pytest.raises(ConfigError, match="plugins that failed to load: plugin 'broken' from distribution broken-plugin"):
        CacheEngine(loaded, namespace=NS, plugins=pm)


@pytest.mark.parametrize("blocked", ["good", "Good_Plugin", "good-plugin"])
def test_block_plugins_env_var(dists: dict[str, str], blocked: str) -> None:
    pm = PluginManager(env={"LMCACHE_CORE_BLOCK_PLUGINS": f" broken , {blocked}"})
    backends = pm.backends()
    assert dists["good_backend"] not in backends
    assert "example_dict" in backends and "local_cpu" in backends
    assert pm.load_errors == []
    assert dists["good_mod"] not in sys.modules and not Path(dists["imports_log"]).exists()


class Misspelled:
    @hookimpl
    def register_backendz(self, register) -> None:  # type: ignore[no-untyped-def]
        register("never", lambda section, ctx: None)


def test_misspelled_hook_fails_registration_clearly() -> None:
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(PluginError) as exc:
        pm.register(Misspelled(), name="typo-plugin")
    msg = str(exc.value)
    assert "typo-plugin" in msg and "register_backendz" in msg and "register_backends" in msg
    assert set(pm.backends()) == {"local_cpu"}  # nothing half-registered
    with pm.registered(Good(), name="typo-plugin"):  # the name is free again
        assert "good_in_code" in pm.backends()


def test_misspelled_hook_in_a_distribution_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = f"typo_plugin_{uuid.uuid4().hex[:8]}"
    src = "from lmcache_core.hookspecs import hookimpl\n\n@hookimpl\ndef register_backendz(register):\n    pass\n"
    make_distribution(tmp_path, "typo-dist", "0.9", {"typo": mod}, {mod: src})
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager()
    assert "example_dict" in pm.backends()
    assert len(pm.load_errors) == 1 and "typo-dist 0.9" in pm.load_errors[0] and "register_backendz" in pm.load_errors[0]


class Good:
    @hookimpl
    def register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
        from lmcache_backend_example import create_dict_backend

        register("good_in_code", create_dict_backend)


class Raising:
    @hookimpl
    def register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("boom in hook")


class BadName:
    @hookimpl
    def register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
        register("not a name", lambda section, ctx: None)


class NoArgs:
    @hookimpl
    def register_codecs(self) -> None:
        pass


def test_hook_failures_are_reported_and_others_still_register() -> None:
    pm = PluginManager(load_entry_points=False)
    pm.register(Raising(), name="raising")
    pm.register(BadName(), name="bad-name")
    pm.register(NoArgs(), name="no-args")
    pm.register(Good(), name="good")
    assert {"local_cpu", "good_in_code"} <= set(pm.backends())
    assert set(pm.codecs()) == {"raw", "lz4", "fp8"}
    errors = " | ".join(pm.load_errors)
    assert "boom in hook" in errors and "must be an identifier" in errors and len(pm.load_errors) == 2


def test_factory_must_return_a_backend() -> None:
    class ReturnsNone:
        @hookimpl
        def register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
            register("returns_none", lambda section, ctx: None)

    pm = PluginManager(load_entry_points=False)
    pm.register(ReturnsNone(), name="rn")
    loaded = load_config(env={}, overrides={"backends": [{"name": "returns_none"}]})
    with pytest.raises(TypeError, match="not a StorageBackend"):
        CacheEngine(loaded, namespace=NS, plugins=pm)


# -- the example third-party distribution -------------------------------------------


def test_example_backend_is_installed_with_its_distribution() -> None:
    info = PluginManager().backends()["example_dict"]
    assert info.origin.distribution == "lmcache-backend-example"
    assert info.origin.plugin == "example_dict"


def test_example_backend_selected_from_yaml(tmp_path: Path) -> None:
    from lmcache_backend_example import DictBackend

    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(
        "chunk_size: 16\nserde: lz4\nbackends:\n"
        "  - name: local_cpu\n    max_size: 1MiB\n"
        "  - name: example_dict\n    max_entries: 100\n"
    )
    with CacheEngine(load_config(cfg, env={}), namespace=NS, plugins=PluginManager()) as eng:
        assert isinstance(eng.tiers[1], DictBackend)
        toks = list(range(48))
        chunks = [torch.full((2, 16, 8), float(i), dtype=torch.float16) for i in range(3)]
        assert store_tokens(eng, toks, chunks) == 3
        assert eng.flush(10)
        keys = eng.keys(token_hashes(eng, toks))
        assert eng.tiers[1].contains(keys) == 3
        for k in keys:
            eng.tiers[0].remove(k)
        outs = [torch.empty(2, 16, 8, dtype=torch.float16) for _ in range(3)]
        assert retrieve_tokens(eng, toks, outs) == 3  # served by example_dict, through lz4 frames
        assert all(torch.equal(o, c) for o, c in zip(outs, chunks))


def test_example_backend_validates_its_section(tmp_path: Path) -> None:
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text("backends:\n  - name: local_cpu\n    max_size: 1MiB\n  - name: example_dict\n    max_entries: -3\n")
    with pytest.raises(ConfigError, match=rf"backends\[1\]\.max_entries: .*\(from {cfg}\)"):
        CacheEngine(load_config(cfg, env={}), namespace=NS, plugins=PluginManager())


def _example_suite() -> type:
    """The example distribution's own conformance class (its storage fixtures included),
    loaded from its file: what a backend author ships, run here in CI."""
    path = Path(__file__).resolve().parents[2] / "examples/lmcache-backend-example/tests/test_conformance.py"
    spec = importlib.util.spec_from_file_location("lmcache_backend_example_conformance", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TestDictBackend


class TestExampleBackendConformance(_example_suite()):  # type: ignore[misc]
    """The example's suite, on a backend made through its entry point's factory."""

    codec = "lz4"

    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> StorageBackend:
        factory = PluginManager().backends()["example_dict"].load_factory()
        return factory({"max_entries": 1000}, ctx)


def test_example_backend_drops_oldest_past_max_entries() -> None:
    factory = PluginManager().backends()["example_dict"].load_factory()
    b = factory({"max_entries": 2}, make_context(1 << 20))
    keys = [NS.key(bytes([i]) * 16) for i in range(3)]
    for k in keys:
        b.put(k, torch.zeros(4))
    assert [b.contains([k]) for k in keys] == [0, 1, 1]
