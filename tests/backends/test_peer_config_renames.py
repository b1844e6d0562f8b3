"""The peer section's durations are seconds; its old millisecond keys (``timeout_ms``,
``connect_timeout_ms``, ``retry_after_ms``, ``handshake_timeout_ms``,
``eviction_poll_ms``) still work for one release, converted, with a deprecation
warning that names the key path. So do the node's ``--timeout-ms`` and
``--handshake-timeout-ms`` flags. Both spellings at once are an error."""

from __future__ import annotations

import warnings

import pytest

from lmcache_backend_peer.backend import PeerBackend
from lmcache_backend_peer.cli import build_parser, seconds_flag
from lmcache_backend_peer.config import PeerConfig
from lmcache_backend_peer.factory import create_peer_backend
from lmcache_core.config import ConfigError, load_config, validate_section
from lmcache_core.testing import make_context

BASE = {"peers": ["127.0.0.1:9"], "secret": "s" * 16}
OLD = {"timeout_ms": 1500, "connect_timeout_ms": 250, "retry_after_ms": 0, "handshake_timeout_ms": 800, "eviction_poll_ms": 100}
NEW = {"timeout_s": 1.5, "connect_timeout_s": 0.25, "retry_after_s": 0.0, "handshake_timeout_s": 0.8, "eviction_poll_s": 0.1}


def validate(section: dict[str, object]) -> PeerConfig:
    return validate_section(PeerConfig, {**BASE, **section}, "backends[1]", "cfg.yaml")


def test_new_keys_are_seconds() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = validate(NEW)
        default = validate({})
    assert (cfg.timeout_s, cfg.connect_timeout_s, cfg.retry_after_s) == (1.5, 0.25, 0.0)
    assert (cfg.handshake_timeout_s, cfg.eviction_poll_s) == (0.8, 0.1)
    assert (default.timeout_s, default.connect_timeout_s, default.retry_after_s) == (2.0, 0.5, 1.0)
    assert (default.handshake_timeout_s, default.eviction_poll_s) == (1.0, 2.0)


@pytest.mark.parametrize("old", sorted(OLD))
def test_each_old_key_gives_the_same_value_and_warns(old: str) -> None:
    new = old[: -len("_ms")] + "_s"
    with pytest.warns(DeprecationWarning, match=rf"backends\[1\]\.{old} \(from cfg\.yaml\) is deprecated: use {new}: "):
        via_old = validate({old: OLD[old]})
    assert via_old == validate({new: NEW[new]})


def test_the_backend_gets_seconds_from_old_keys() -> None:
    with pytest.warns(DeprecationWarning):
        backend = create_peer_backend({**BASE, "max_size": 0, **OLD}, make_context(key_path="backends[1]"))
    try:
        assert isinstance(backend, PeerBackend)
        client = backend._peers[0].client
        assert (client.timeout, client.connect_timeout) == (1.5, 0.25)
        assert (backend.retry_after, backend.eviction_poll) == (0.0, 0.1)
    finally:
        backend.close()


def test_old_keys_in_a_config_file(tmp_path) -> None:
    p = tmp_path / "cfg.yaml"
    p.write_text(
        "backends:\n  - name: local_cpu\n    max_size: 8MiB\n  - {name: peer, peers: ['127.0.0.1:9'], timeout_ms: 700}\n"
    )
    loaded = load_config(p, env={})  # the core leaves the section to the backend
    section = loaded.config.backends[1].options()
    with pytest.warns(DeprecationWarning, match=rf"backends\[1\]\.timeout_ms \(from {p}\)"):
        cfg = validate_section(PeerConfig, {**section, "secret": "s" * 16}, "backends[1]", loaded.source_of("backends"))
    assert cfg.timeout_s == 0.7


def test_both_spellings_are_an_error_naming_the_key_path() -> None:
    with pytest.raises(ConfigError) as err:
        validate({"timeout_ms": 1000, "timeout_s": 1.0})
    assert str(err.value) == (
        "invalid configuration:\n  backends[1].timeout_ms: both timeout_ms (deprecated, milliseconds) and timeout_s "
        "(seconds) are set; give only timeout_s (from cfg.yaml)"
    )


def test_old_value_that_is_not_a_number_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"backends\[1\]\.retry_after_ms: expected a number of milliseconds, got '1s'"):
        validate({"retry_after_ms": "1s"})


def test_converted_values_meet_the_new_bounds() -> None:
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ConfigError, match=r"eviction_poll_s: .*must be 0 \(off\) or a number of seconds from 0\.05 to 3600"),
    ):
        validate({"eviction_poll_ms": 20})
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match=r"backends\[1\]\.timeout_s: .*from 0\.001 to 3600"):
        validate({"timeout_ms": 0})


def test_keys_never_renamed_do_not_warn() -> None:
    """Negative control: a section without any old key raises no deprecation warning,
    and an ``_ms`` spelling of a key that never had one is still unknown."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        validate({"max_size": "1MiB", "pool_size": 2, "push": True})
    with pytest.raises(ConfigError, match=r"backends\[1\]\.pool_size_ms: unknown key"):
        validate({"pool_size_ms": 2})


def test_node_flags_in_seconds_and_deprecated_milliseconds(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["--listen", "127.0.0.1:0", "--timeout-s", "1.5"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert seconds_flag(args, parser, "timeout", 5.0) == 1.5
        assert seconds_flag(args, parser, "handshake-timeout", 1.0) == 1.0  # the default
    args = parser.parse_args(["--listen", "127.0.0.1:0", "--timeout-ms", "1500", "--handshake-timeout-ms", "250"])
    with pytest.warns(DeprecationWarning, match=r"--timeout-ms is deprecated: use --timeout-s 1\.5 \(seconds\)"):
        assert seconds_flag(args, parser, "timeout", 5.0) == 1.5
    with pytest.warns(DeprecationWarning, match="--handshake-timeout-ms"):
        assert seconds_flag(args, parser, "handshake-timeout", 1.0) == 0.25
    assert "--timeout-ms is deprecated" in capsys.readouterr().err
    for bad in (["--timeout-s", "1", "--timeout-ms", "1000"], ["--timeout-s", "0"], ["--timeout-s", "inf"]):
        args = parser.parse_args(["--listen", "127.0.0.1:0", *bad])
        with pytest.raises(SystemExit), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            seconds_flag(args, parser, "timeout", 5.0)
    assert "both --timeout-ms (deprecated, milliseconds) and --timeout-s (seconds) are set" in capsys.readouterr().err
