"""The mooncake section's validation (errors name the key path and source) and the
plugin's laziness: loading the entry point must not import the native client."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmcache_backend_mooncake import create_mooncake_backend
from lmcache_core.config import ConfigError
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
        ({"timout_ms": 5}, r"backends\[2\]\.timout_ms: .*(unknown key|Extra inputs)"),
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
