"""Connector configuration and per-request options.

Configuration: the core's YAML/env config, then ``kv_connector_extra_config``
overrides: ``config_file`` (a YAML path) and any core key (``chunk_size``,
``backends``, ...), plus connector keys (``model_id``, ``async_saves``, ``async_loads``, ``layerwise``). Errors name
``kv_connector_extra_config.<key>``.

Per-request options come in ``kv_transfer_params`` (``SamplingParams.extra_args``):
``lmcache.skip_save: true``, ``lmcache.tag.<name>: <str>`` and ``lmcache.verify: true|false``
(recompute this request's hit and compare it with the cache, or never; default: sampled
with ``verify_fraction``, see :mod:`lmcache_core.canary`). A malformed option
never fails the request: the request is served without the cache (no load, no save)
and a warning says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from lmcache_core.config import CoreConfig, LoadedConfig, load_config

from .log import get_logger

log = get_logger(__name__)

CONNECTOR_KEYS = {"config_file", "model_id", "async_saves", "async_loads", "layerwise"}
AUTO = "auto"  # async_loads: in the background only when a tier slower than memory serves the hit
SKIP_SAVE = "lmcache.skip_save"
VERIFY = "lmcache.verify"
TAG_PREFIX = "lmcache.tag."


@dataclass(frozen=True)
class ConnectorSettings:
    loaded: LoadedConfig
    model_id: str | None = None
    async_saves: bool = False  # see async_saves.py
    async_loads: bool | str = AUTO  # True, False or "auto"; see async_loads.py
    layerwise: bool = False  # see layerwise.py

    @property
    def core(self) -> CoreConfig:
        return self.loaded.config

    def with_chunk_size(self, chunk_size: int) -> "ConnectorSettings":
        """The same settings with the chunk size the model needs (the key's source
        stays the one the user's value came from)."""
        cfg = self.loaded.config.model_copy(update={"chunk_size": chunk_size})
        return replace(self, loaded=replace(self.loaded, config=cfg))


def load_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Core config with ``kv_connector_extra_config`` applied on top."""
    extra = dict(extra or {})
    path = extra.pop("config_file", None)
    model_id = extra.pop("model_id", None)
    if model_id is not None and not isinstance(model_id, str):
        from lmcache_core.config import ConfigError

        raise ConfigError("kv_connector_extra_config.model_id: must be a string (from kv_connector_extra_config)")
    switches = {key: extra.pop(key, False) for key in ("async_saves", "layerwise")}
    switches["async_loads"] = extra.pop("async_loads", AUTO)
    for key, value in switches.items():
        if key == "async_loads" and value == AUTO:
            continue
        if not isinstance(value, bool):
            from lmcache_core.config import ConfigError

            raise ConfigError(
                f"kv_connector_extra_config.{key}: must be true or false"
                + (" or auto" if key == "async_loads" else "")
                + f", got {value!r} (from kv_connector_extra_config)"
            )
    loaded = load_config(path, overrides=extra, overrides_source="kv_connector_extra_config")
    return ConnectorSettings(loaded, model_id, switches["async_saves"], switches["async_loads"], switches["layerwise"])


@dataclass(frozen=True)
class RequestOptions:
    skip_save: bool = False
    skip_load: bool = False
    tags: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    verify: bool | None = None  # None: sampled with verify_fraction


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
    tags: dict[str, str] = {}
    for key, value in params.items():
        if isinstance(key, str) and key.startswith(TAG_PREFIX):
            name = key[len(TAG_PREFIX) :]
            if not name or not isinstance(value, (str, int)) or isinstance(value, bool):
                return _bad(request_id, f"{key} must be a non-empty tag name with a string value, got {value!r}")
            tags[name] = str(value)
        elif isinstance(key, str) and key.startswith("lmcache.") and key not in (SKIP_SAVE, VERIFY):
            return _bad(request_id, f"unknown option {key!r} (known: {SKIP_SAVE}, {VERIFY}, {TAG_PREFIX}<name>)")
    return RequestOptions(skip_save=skip_save, tags=tags, verify=verify)


def _bad(request_id: str, why: str) -> RequestOptions:
    msg = f"request {request_id}: {why}; serving it without the KV cache"
    log.warning(msg)
    return RequestOptions(skip_save=True, skip_load=True, problem=msg)
