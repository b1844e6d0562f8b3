"""Connector configuration and per-request options.

Configuration: the core's YAML/env config, then ``kv_connector_extra_config``
overrides: ``config_file`` (a YAML path) and any core key (``chunk_size``,
``backends``, ...), the connector's own keys under ``connector:`` (``model_id``,
``async_saves``, ``async_loads``, ``layerwise``, ``save_unfull_chunk``, ...). Errors name
the key path and ``kv_connector_extra_config`` as its source.

Per-request options come in ``kv_transfer_params`` (``SamplingParams.extra_args``):
``lmcache.skip_save: true``, ``lmcache.tag.<name>: <str>``, ``lmcache.verify: true|false``
(recompute this request's hit and compare it with the cache, or never; default: sampled
with ``verify_fraction``, see :mod:`lmcache_core.canary`), and the retention hint
``lmcache.retention_seconds: <seconds>`` with ``lmcache.priority: 0-99`` (the chunks
the request stores or hits outlive unretained ones that long, see
:mod:`lmcache_core.retention`). A malformed option
never fails the request: the request is served without the cache (no load, no save)
and a warning says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from lmcache_core.config import ConfigError, LoadedConfig, load_config, moved_keys
from lmcache_core.retention import MAX_PRIORITY, MAX_SECONDS

from .log import get_logger
from .settings import ASYNC_AUTO, ConnectorConfig

log = get_logger(__name__)

AUTO = ASYNC_AUTO  # connector.async_loads: in the background only when a tier slower than memory serves the hit
SKIP_SAVE = "lmcache.skip_save"
VERIFY = "lmcache.verify"
RETENTION = "lmcache.retention_seconds"
PRIORITY = "lmcache.priority"
KNOWN = (SKIP_SAVE, VERIFY, RETENTION, PRIORITY)
TAG_PREFIX = "lmcache.tag."
SOURCE = "kv_connector_extra_config"  # the source its errors and warnings name
#: the keys only kv_connector_extra_config took before ``connector:`` (the core's own
#: moved keys, ``save_unfull_chunk`` and the rest, are moved by load_config from every source)
EXTRA_CONFIG_MOVES = {key: f"connector.{key}" for key in ("model_id", "async_saves", "async_loads", "layerwise")}


@dataclass(frozen=True)
class ConnectorSettings:
    """The loaded configuration (a :class:`~lmcache_connector.settings.ConnectorConfig`);
    the connector's own keys are in ``core.connector`` (the properties below read the
    switches from there)."""

    loaded: LoadedConfig
    # ``async_saves: auto`` as resolved for this engine (see ``for_engine``); both roles
    # resolve it from the same vLLM config, so they agree
    auto_saves: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.loaded.config, ConnectorConfig):
            raise TypeError(
                f"ConnectorSettings needs a ConnectorConfig (load_config(..., model=ConnectorConfig)), "
                f"got {type(self.loaded.config).__name__}"
            )

    @property
    def core(self) -> ConnectorConfig:
        cfg = self.loaded.config
        assert isinstance(cfg, ConnectorConfig)  # __post_init__
        return cfg

    @property
    def model_id(self) -> str | None:
        return self.core.connector.model_id

    @property
    def async_saves(self) -> bool:  # see transfers/async_saves.py
        value = self.core.connector.async_saves
        return self.auto_saves if value == "auto" else bool(value)

    @property
    def saves_on_spare_cores(self) -> bool:
        """``async_saves: auto`` chose background saves: their thread runs on the cores
        the model is not bound to, at nice 19 (whatever ``background_cores`` and
        ``background_nice`` say for the other background threads)."""
        return self.core.connector.async_saves == "auto" and self.auto_saves

    def for_engine(self, auto_saves: bool) -> "ConnectorSettings":
        """These settings with ``async_saves: auto`` resolved (features.cpu_cores.auto_async_saves)."""
        return replace(self, auto_saves=auto_saves)

    @property
    def async_loads(self) -> bool | str:  # True, False or "auto"; see transfers/async_loads.py
        return self.core.connector.async_loads

    @property
    def layerwise(self) -> bool:  # see transfers/layerwise.py
        return self.core.connector.layerwise

    def with_chunk_size(self, chunk_size: int) -> "ConnectorSettings":
        """The same settings with the chunk size the model needs (the key's source
        stays the one the user's value came from)."""
        cfg = self.loaded.config.model_copy(update={"chunk_size": chunk_size})
        return replace(self, loaded=replace(self.loaded, config=cfg))


def load_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Core config with ``kv_connector_extra_config`` applied on top: ``config_file``
    names the YAML file, every other key overrides the core config (``connector:
    {...}`` merges key by key; the connector's old flat keys move there with a
    deprecation warning, see :func:`lmcache_core.config.moved_keys`)."""
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config: expected a mapping of keys, got {type(extra).__name__}")
    extra = dict(extra or {})
    path = extra.pop("config_file", None)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f"kv_connector_extra_config.config_file: expected the path of a YAML file, got {type(path).__name__} "
            "(from kv_connector_extra_config)"
        )
    extra = moved_keys(extra, EXTRA_CONFIG_MOVES, "", lambda _path: SOURCE)
    return ConnectorSettings(load_config(path, overrides=extra, overrides_source=SOURCE, model=ConnectorConfig))


@dataclass(frozen=True)
class RequestOptions:
    skip_save: bool = False
    skip_load: bool = False
    tags: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    verify: bool | None = None  # None: sampled with verify_fraction
    retention: tuple[float, int] | None = None  # (seconds, priority): a retention hint


def parse_request_options(params: Mapping[str, Any] | None, request_id: str = "?") -> RequestOptions:
    if not params:
        return RequestOptions()
    if not isinstance(params, Mapping):
        return _bad(request_id, f"kv_transfer_params must be a mapping, got {type(params).__name__}")
    skip_save = params.get(SKIP_SAVE, False)
    if not isinstance(skip_save, bool):
        return _bad(request_id, f"{SKIP_SAVE} must be true or false, got {skip_save!r}")
    verify = params.get(VERIFY)
    if verify is not None and not isinstance(verify, bool):
        return _bad(request_id, f"{VERIFY} must be true or false, got {verify!r}")
    retention = None
    seconds, priority = params.get(RETENTION), params.get(PRIORITY, 0)
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_SECONDS:
            return _bad(request_id, f"{RETENTION} must be a number of seconds in (0, {MAX_SECONDS:.0f}], got {seconds!r}")
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
            return _bad(request_id, f"{PRIORITY} must be an integer from 0 to {MAX_PRIORITY}, got {priority!r}")
        retention = (float(seconds), priority)
    elif PRIORITY in params:
        return _bad(request_id, f"{PRIORITY} orders retention hints: it needs {RETENTION}")
    tags: dict[str, str] = {}
    for key, value in params.items():
        if isinstance(key, str) and key.startswith(TAG_PREFIX):
            name = key[len(TAG_PREFIX) :]
            if not name or not isinstance(value, (str, int)) or isinstance(value, bool):
                return _bad(request_id, f"{key} must be a non-empty tag name with a string value, got {value!r}")
            tags[name] = str(value)
        elif isinstance(key, str) and key.startswith("lmcache.") and key not in KNOWN:
            return _bad(request_id, f"unknown option {key!r} (known: {', '.join(KNOWN)}, {TAG_PREFIX}<name>)")
    return RequestOptions(skip_save=skip_save, tags=tags, verify=verify, retention=retention)


def _bad(request_id: str, why: str) -> RequestOptions:
    msg = f"request {request_id}: {why}; serving it without the KV cache"
    log.warning(msg)
    return RequestOptions(skip_save=True, skip_load=True, problem=msg)
