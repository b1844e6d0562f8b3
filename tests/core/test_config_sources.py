"""One rule per config key whatever its source, and bounds on every duration.

YAML scalars from a file or an env var are read the way JSON reads them (YAML 1.2's
core schema), as ``kv_connector_extra_config`` is: ``yes``/``on``/``no``/``off`` are
text, never booleans, so a key means the same from every source. Every boolean key
takes exactly true/false (not ``1``, not ``"yes"``), and every duration key (``*_s``,
core, connector or backend) takes a number of seconds from 1 ms to a bound of its own
(0 only where it means "off"): ``1e-300``, ``1e300`` and ``.inf`` are refused.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, get_args

import pytest
from pydantic import BaseModel, TypeAdapter

from lmcache_backend_disk.config import DiskConfig
from lmcache_backend_mooncake.config import MooncakeConfig
from lmcache_backend_peer.config import PeerConfig
from lmcache_backend_redis.config import RedisConfig
from lmcache_backend_s3.config import S3Config
from lmcache_connector.options import load_settings
from lmcache_connector.settings import ConnectorConfig
from lmcache_core.config import ConfigError, LoadedConfig, safe_yaml
from lmcache_core.config import load_config as core_load_config
from lmcache_core.local_cpu import LocalCpuConfig

ROOT = Path(__file__).resolve().parents[2]

# (the word as written in a YAML file or env var, the same value in vLLM's JSON)
WORDS: list[tuple[str, Any]] = [
    ("yes", "yes"),
    ("on", "on"),
    ("no", "no"),
    ("off", "off"),
    ("1", 1),
    ("0", 0),
    ("'true'", "true"),
    ("true", True),
    ("false", False),
    ("True", True),
    ("1e-300", 1e-300),
    ("1e300", 1e300),
    ("0.5", 0.5),
    ("2", 2),
    ("'2'", "2"),
    ("prefill", "prefill"),
]
BOOLEAN_KEYS = ["connector.save_unfull_chunk", "connector.layerwise", "connector.sub_chunk_hits", "populate_pool"]
KEYS = [*BOOLEAN_KEYS, "connector.save_decode_cache", "connector.async_loads", "connector.lookup_timeout_s", "verify_window_s"]


def load_config(*args: Any, **kw: Any) -> LoadedConfig:
    """The config with the connector's section, as the connector (and, where it is
    installed, every lmcache-core command) loads it."""
    return core_load_config(*args, model=ConnectorConfig, **kw)


def _value(loaded: LoadedConfig, key: str) -> Any:
    obj: Any = loaded.config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _nested(key: str, value: Any) -> dict[str, Any]:
    section, _, sub = key.partition(".")
    return {section: {sub: value}} if sub else {key: value}


def _outcome(load: Callable[[], LoadedConfig], key: str, source: str) -> tuple[str, Any]:
    try:
        return "taken", _value(load(), key)
    except ConfigError as err:
        assert key in str(err) and source in str(err), str(err)  # names the key and where it came from
        return "refused", None


def _outcomes(tmp_path: Path, key: str, word: str, json_value: Any) -> dict[str, tuple[str, Any]]:
    section, _, sub = key.partition(".")
    f = tmp_path / "c.yaml"
    f.write_text(f"{section}:\n  {sub}: {word}\n" if sub else f"{key}: {word}\n")
    env = "LMCACHE_CORE_" + key.replace(".", "_").upper()
    return {
        "file": _outcome(lambda: load_config(f, env={}), key, str(f)),
        "env": _outcome(lambda: load_config(None, env={env: word}), key, f"env var {env}"),
        "vllm": _outcome(lambda: load_settings(_nested(key, json_value)).loaded, key, "kv_connector_extra_config"),
    }


@pytest.mark.parametrize("key", KEYS)
def test_a_word_means_the_same_from_every_source(tmp_path: Path, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file, an env var and kv_connector_extra_config agree on every word: taken with
    the same value, or refused with an error naming the key and the source."""
    for name in [n for n in os.environ if n.startswith("LMCACHE_CORE_")]:
        monkeypatch.delenv(name)  # load_settings reads the process environment
    for word, json_value in WORDS:
        got = _outcomes(tmp_path, key, word, json_value)
        assert got["file"] == got["env"] == got["vllm"], (word, got)


@pytest.mark.parametrize("key", [*BOOLEAN_KEYS, "connector.save_decode_cache", "connector.async_loads"])
def test_boolean_keys_take_true_and_false_only(tmp_path: Path, key: str) -> None:
    """The finding: yes/on from a file or env var turned save_decode_cache on."""
    for word in ("yes", "on", "no", "off", "1", "0", "'true'", "y"):
        f = tmp_path / "c.yaml"
        section, _, sub = key.partition(".")
        f.write_text(f"{section}:\n  {sub}: {word}\n" if sub else f"{key}: {word}\n")
        with pytest.raises(ConfigError, match=rf"{re.escape(key)}: .*must be true(,| or) false.* \(from {re.escape(str(f))}\)"):
            load_config(f, env={})
    # negative control: the booleans themselves, in every spelling YAML 1.2 has
    for word, value in (("true", True), ("false", False), ("True", True), ("FALSE", False)):
        f.write_text(f"{section}:\n  {sub}: {word}\n" if sub else f"{key}: {word}\n")
        assert _value(load_config(f, env={}), key) is value


def test_yaml_numbers_are_read_as_json_reads_them() -> None:
    """YAML 1.1 read 010 as eight, 1:30 as ninety, 1_000 as a thousand and 1e3 as text."""
    got = safe_yaml("a: 010\nb: 1:30\nc: 1_000\nd: 1e3\ne: 2024-01-01\nf: 0x1f\ng: .inf\nh: ~\n", "t")
    assert got == {"a": 10, "b": "1:30", "c": "1_000", "d": 1000.0, "e": "2024-01-01", "f": 31, "g": math.inf, "h": None}
    with pytest.raises(ConfigError, match="t: not a usable number"):
        safe_yaml("a: " + "9" * 5000, "t")


# -- durations ------------------------------------------------------------------------------

MODELS: list[type[BaseModel]] = [ConnectorConfig, LocalCpuConfig, DiskConfig, RedisConfig, S3Config, MooncakeConfig, PeerConfig]
DOCS = {
    ConnectorConfig: "config.md",
    LocalCpuConfig: "config.md",
    DiskConfig: "backends/disk.md",
    RedisConfig: "backends/redis.md",
    S3Config: "backends/s3.md",
    MooncakeConfig: "backends/mooncake.md",
    PeerConfig: "backends/peer.md",
}
DURATION = re.compile(r"(?<!_per)_s$|timeout|interval|cooldown|deadline|_ttl|poll|window")


def duration_keys() -> Iterator[tuple[type[BaseModel], str, Any]]:
    """(model, dotted key, field) of every duration key: the name says seconds."""

    def walk(model: type[BaseModel], prefix: str) -> Iterator[tuple[type[BaseModel], str, Any]]:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(ann, f"{prefix}{name}.")
            elif DURATION.search(name):
                yield model, prefix + name, field

    for m in MODELS:
        yield from ((m, key, field) for _, key, field in walk(m, ""))


def _bounds(field: Any) -> tuple[float, float, bool] | None:
    """The bounds of the key's ``seconds()`` validator, on the field or inside its
    type (``Annotated[float, seconds(...)] | None``)."""
    metas = list(field.metadata)
    todo = [field.annotation]
    while todo:
        args = get_args(todo.pop())
        todo += list(args)
        metas += list(args)
    for meta in metas:
        bounds = getattr(getattr(meta, "func", None), "duration_bounds", None)
        if bounds is not None:
            return bounds  # type: ignore[no-any-return]
    return None


def test_the_duration_scan_finds_the_known_keys() -> None:
    """Negative control for the scan below: it sees the keys of every model, and no
    key that is not a duration (a rate in ``*_per_s``, a fraction)."""
    found = [f"{model.__name__}.{key}" for model, key, _ in duration_keys()]
    known = [
        "ConnectorConfig.connector.lookup_timeout_s",
        "ConnectorConfig.verify_window_s",
        "RedisConfig.ttl_s",
        "S3Config.op_deadline_s",
    ]
    known += ["MooncakeConfig.quarantine_s", "PeerConfig.eviction_poll_s", "PeerConfig.handshake_timeout_s"]
    assert set(known) <= set(found) and len(found) == 21, found
    assert not [k for k in found if k.endswith(("_per_s", "verify_fraction", "load_margin"))]


DURATION_CASES = [pytest.param(m, k, f, id=f"{m.__name__}.{k}") for m, k, f in duration_keys()]


@pytest.mark.parametrize(("model", "key", "field"), DURATION_CASES)
def test_every_duration_key_is_bounded(model: type[BaseModel], key: str, field: Any) -> None:
    bounds = _bounds(field)
    assert bounds is not None, f"{model.__name__}.{key} has no seconds() bounds"
    low, high, off = bounds
    assert 0 < low <= 1 and 1 <= high <= 366 * 86400
    check = TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)
    for bad in (1e-300, 1e300, 10**400, math.inf, -math.inf, math.nan, -1, True, "2", low / 2, high * 1.001):
        with pytest.raises(ValueError):
            check.validate_python(bad)
    assert check.validate_python(low) == low and check.validate_python(high) == high
    if field.default is not None:
        assert check.validate_python(field.default) == field.default
    assert (check.validate_python(0) == 0) if off else pytest.raises(ValueError, check.validate_python, 0)


@pytest.mark.parametrize(("model", "key", "field"), DURATION_CASES)
def test_every_duration_row_says_its_bounds(model: type[BaseModel], key: str, field: Any) -> None:
    bounds = _bounds(field)
    assert bounds is not None
    low, high, off = bounds
    name = key.rsplit(".", 1)[-1]
    text = (ROOT / "docs" / DOCS[model]).read_text()
    row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
    assert row is not None, f"docs/{DOCS[model]} has no row for {name}"
    said = f"{low:.10g}–{high:.10g} s"
    assert said in row and (("`0`" in row) if off else True), f"docs/{DOCS[model]}: the {name} row should say {said}"


def test_the_limit_in_a_message_names_key_source_and_bounds(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("connector:\n  lookup_timeout_s: 1e300\n")
    with pytest.raises(ConfigError) as err:
        load_config(f, env={})
    assert (
        f"connector.lookup_timeout_s: Value error, must be a number of seconds from 0.001 to 600 (10 minutes), got 1e+300 (from {f})"
        in str(err.value)
    )
