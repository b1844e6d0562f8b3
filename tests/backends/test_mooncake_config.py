"""The mooncake section's validation (errors name the key path and source) and the
plugin's laziness: loading the entry point must not import the native client."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from lmcache_backend_mooncake import create_mooncake_backend
from lmcache_backend_mooncake.config import MooncakeConfig
from lmcache_core.config import ConfigError, validate_section
from lmcache_core.testing import make_context

BASE = {"master": "127.0.0.1:50051", "metadata": "http://127.0.0.1:8080/metadata"}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"master": "nohost"}, r"backends\[2\]\.master: .*expected host:port"),
        ({"master": "h:70000"}, r"backends\[2\]\.master: .*expected host:port"),
        ({"metadata": "127.0.0.1:8080"}, r"backends\[2\]\.metadata: .*http://host:port/metadata"),
        ({"protocol": "udp"}, r"backends\[2\]\.protocol"),
        ({"segment_size": "1MiB"}, r"segment_size must be 0 or at least 16MiB"),
        ({"staging_size": "lots"}, r"backends\[2\]\.staging_size: .*expected a size"),
        ({"rdma_devices": "mlx5_0"}, r"rdma_devices is only used with protocol: rdma"),
        ({"replicas": 0}, r"backends\[2\]\.replicas"),
        ({"key_prefix": "a b"}, r"backends\[2\]\.key_prefix"),
        ({"timout_s": 5}, r"backends\[2\]\.timout_s: .*(unknown key|Extra inputs)"),
    ],
)
def test_bad_values_name_the_key_and_source(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        create_mooncake_backend({**BASE, **options}, make_context(key_path="backends[2]"))
    assert "(from test)" in str(err.value)


def test_loading_the_plugin_does_not_import_the_client() -> None:
    code = (
        "import sys, lmcache_backend_mooncake.plugin, lmcache_backend_mooncake;"
        "assert 'mooncake' not in sys.modules and 'mooncake.store' not in sys.modules, sorted(sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_durations_are_seconds_and_old_ms_keys_warn() -> None:
    """``timeout_s``, ``setup_timeout_s`` and ``down_cooldown_s`` are seconds; the old
    ``*_ms`` keys give the same values with a deprecation warning, for one release."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # negative control: nothing renamed here
        default = validate_section(MooncakeConfig, BASE, "backends[2]", "test")
        new = validate_section(
            MooncakeConfig, {**BASE, "timeout_s": 0.8, "setup_timeout_s": 5, "down_cooldown_s": 0}, "backends[2]", "test"
        )
    assert (default.timeout_s, default.setup_timeout_s, default.down_cooldown_s) == (2.0, 15.0, 2.0)
    old = {**BASE, "timeout_ms": 800, "setup_timeout_ms": 5000, "down_cooldown_ms": 0}
    with pytest.warns(DeprecationWarning) as record:
        assert validate_section(MooncakeConfig, old, "backends[2]", "test") == new
    assert sorted(str(w.message) for w in record) == [
        "backends[2].down_cooldown_ms (from test) is deprecated: use down_cooldown_s: 0.0 (seconds)",
        "backends[2].setup_timeout_ms (from test) is deprecated: use setup_timeout_s: 5.0 (seconds)",
        "backends[2].timeout_ms (from test) is deprecated: use timeout_s: 0.8 (seconds)",
    ]
    with pytest.raises(ConfigError, match=r"backends\[2\]\.down_cooldown_ms: both .*give only down_cooldown_s \(from test\)"):
        create_mooncake_backend({**BASE, "down_cooldown_ms": 1, "down_cooldown_s": 1}, make_context(key_path="backends[2]"))
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ConfigError, match=r"backends\[2\]\.timeout_s: .*from 0\.001 to 600 \(10 minutes\), got 600\.001"),
    ):
        validate_section(MooncakeConfig, {**BASE, "timeout_ms": 600_001}, "backends[2]", "test")
