"""Truly lazy plugins: loading the registry (``lmcache-core plugins``) imports only the
light entry-point modules, and selecting one backend imports that backend and nothing
of the others. Each check runs in a fresh interpreter and reads its ``sys.modules``."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_core.plugins import ENTRY_POINT_GROUP

# Third-party libraries only some tier or the connector needs.
HEAVY = ("boto3", "botocore", "redis", "mooncake", "vllm", "transformers", "moto")

PLUGINS = """
import json, sys
from lmcache_core import cli
rc = cli.main(["plugins"])
json.dump({"rc": rc, "modules": sorted(sys.modules)}, sys.stderr)
"""

SELECT = """
import json, sys
from lmcache_core import CacheEngine, KeyNamespace, load_config
cfg = load_config(overrides={"backends": [{"name": "local_cpu", "max_size": "16MiB"},
                                          {"name": "disk", "path": sys.argv[1], "max_size": "16MiB"}]})
with CacheEngine(cfg, namespace=KeyNamespace(model="m")) as engine:
    names = [t.name for t in engine.tiers]
json.dump({"tiers": names, "modules": sorted(sys.modules)}, sys.stderr)
"""


def _modules(script: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_CORE_")}
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stderr.strip().splitlines()[-1])


def _plugin_packages() -> dict[str, str]:
    """Each installed plugin's top-level package -> its entry-point module."""
    out = {}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        out[ep.module.split(".")[0]] = ep.module
    return out


def _loaded_beyond_entry_points(modules: list[str], packages: dict[str, str], allowed: str = "") -> list[str]:
    extra = []
    for name in modules:
        top = name.split(".")[0]
        if top in packages and name not in (top, packages[top]) and not (allowed and name.startswith(allowed)):
            extra.append(name)
    return extra


def test_listing_plugins_imports_only_the_entry_point_modules() -> None:
    packages = _plugin_packages()
    assert {"lmcache_backend_disk", "lmcache_backend_s3", "lmcache_connector"} <= set(packages)
    seen = _modules(PLUGINS)
    assert seen["rc"] == 0
    for module in packages.values():
        assert module in seen["modules"]  # negative control: the scan sees plugin modules
    assert _loaded_beyond_entry_points(seen["modules"], packages) == []
    assert [m for m in HEAVY if m in seen["modules"]] == []


def test_selecting_one_backend_imports_that_backend_only(tmp_path: Path) -> None:
    packages = _plugin_packages()
    seen = _modules(SELECT, str(tmp_path / "disk"))
    assert seen["tiers"] == ["local_cpu", "disk"]
    assert "lmcache_backend_disk.backend" in seen["modules"]
    assert _loaded_beyond_entry_points(seen["modules"], packages, allowed="lmcache_backend_disk.") == []
    assert [m for m in HEAVY if m in seen["modules"]] == []


@pytest.mark.parametrize("package", ["lmcache_backend_peer", "lmcache_backend_s3"])
def test_public_names_still_import(package: str) -> None:
    """The lazy package exports every name in ``__all__`` (and nothing else)."""
    mod = __import__(package)
    for name in mod.__all__:
        assert getattr(mod, name) is not None
    assert sorted(dir(mod)) == sorted(mod.__all__)
    with pytest.raises(AttributeError):
        _ = mod.no_such_name
