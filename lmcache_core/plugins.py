"""Plugin loading and the backend/codec registry.

The rest of the code calls :class:`PluginManager`'s typed methods, never pluggy
hooks directly. Default plugins (CPU tier, built-in codecs) go through the same hooks
as third-party ones. Entry points in the group ``lmcache_core.backends`` load lazily,
each in its own ``try``: a broken plugin is reported with its distribution name and
the others still load. ``LMCACHE_CORE_BLOCK_PLUGINS=name,name`` (entry-point or
distribution names) keeps named plugins out.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import pluggy

from .backend import BackendContext, BackendFactory, StorageBackend
from .config import ENV_BLOCK_PLUGINS, BackendSection, ConfigError
from .eviction import EvictionPolicy, PolicyFactory
from .hookspecs import PROJECT, Spec
from .serde import Codec

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lmcache_core.backends"

# First-party backends that live in their own distributions: a config naming one
# that is not installed gets the exact command to run.
KNOWN_BACKENDS = {
    "disk": "lmcache-core[disk]",
    "s3": "lmcache-core[s3]",
    "peer": "lmcache-core[peer]",
    "redis": "lmcache-core[redis]",
    "mooncake": "lmcache-core[mooncake]",
}


@dataclass(frozen=True)
class Origin:
    plugin: str
    distribution: str
    version: str


@dataclass(frozen=True)
class BackendInfo:
    name: str
    factory: BackendFactory
    origin: Origin
    description: str = ""


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    factory: PolicyFactory
    origin: Origin
    description: str = ""


@dataclass(frozen=True)
class CodecInfo:
    codec: Codec
    origin: Origin
    description: str = ""


_CORE_DIST = "lmcache-core"


class PluginError(ValueError):
    """A plugin cannot be registered (for example, it implements a hook that does
    not exist, usually a misspelling). The message names the plugin and the hook."""


def normalize_dist_name(name: str) -> str:
    """PEP 503 normalization, so ``My_Plugin`` and ``my-plugin`` block the same thing."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _core_version() -> str:
    try:
        return md.version(_CORE_DIST)
    except md.PackageNotFoundError:
        return "unknown"


class PluginManager:
    def __init__(self, *, load_entry_points: bool = True, env: Mapping[str, str] | None = None) -> None:
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(Spec)
        self._origins: dict[str, Origin] = {}
        self._lock = threading.RLock()
        self._load_entry_points = load_entry_points
        self._entry_points_loaded = False
        self._backends: dict[str, BackendInfo] | None = None
        self._codecs: dict[str, CodecInfo] | None = None
        self._policies: dict[str, PolicyInfo] | None = None
        self.load_errors: list[str] = []
        env = os.environ if env is None else env
        self.blocked = {n.strip() for n in env.get(ENV_BLOCK_PLUGINS, "").split(",") if n.strip()}
        self._blocked_dists = {normalize_dist_name(n) for n in self.blocked}
        from . import default_plugins

        self.register(default_plugins, name="lmcache_core.default", origin=Origin("default", _CORE_DIST, _core_version()))

    # -- registration -----------------------------------------------------------------
    def register(self, plugin: object, *, name: str, origin: Origin | None = None) -> None:
        """Register a plugin object or module under ``name``.

        Raises :class:`PluginError` (and leaves nothing registered) when the plugin
        implements a hook that is not in :mod:`lmcache_core.hookspecs`."""
        with self._lock:
            self._register_checked(plugin, name)
            self._origins[name] = origin or Origin(name, "(registered in code)", "")
            self._backends = self._codecs = self._policies = None

    def _register_checked(self, plugin: object, name: str) -> None:
        try:
            self._pm.register(plugin, name=name)
        except ValueError as err:  # pluggy: name or object already registered
            raise PluginError(f"plugin {name!r}: {err}") from None
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as err:
            self._pm.unregister(name=name)
            known = ", ".join(sorted(n for n in dir(Spec) if not n.startswith("_")))
            raise PluginError(f"plugin {name!r}: {err}; the hooks are: {known}") from None

    def unregister(self, name: str) -> None:
        with self._lock:
            self._pm.unregister(name=name)
            self._origins.pop(name, None)
            self._backends = self._codecs = self._policies = None

    @contextmanager
    def registered(self, plugin: object, *, name: str) -> Iterator[None]:
        """Register ``plugin`` for the duration of a ``with`` block (tests)."""
        self.register(plugin, name=name)
        try:
            yield
        finally:
            self.unregister(name)

    def _ensure_entry_points(self) -> None:
        if self._entry_points_loaded or not self._load_entry_points:
            return
        self._entry_points_loaded = True
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            if ep.name in self.blocked or normalize_dist_name(dist) in self._blocked_dists:
                log.info("plugin %s (%s) blocked by %s", ep.name, dist, ENV_BLOCK_PLUGINS)
                continue
            if self._pm.has_plugin(ep.name):
                continue
            try:
                self._register_checked(ep.load(), ep.name)
            except Exception as err:  # one broken plugin must not hide the others
                msg = f"plugin {ep.name!r} from distribution {dist} {version} failed to load: {type(err).__name__}: {err}"
                self.load_errors.append(msg)
                log.warning(msg)
                continue
            self._origins[ep.name] = Origin(ep.name, dist, version)

    # -- registries -------------------------------------------------------------------
    def _collect(self) -> None:
        with self._lock:
            if self._backends is not None and self._codecs is not None and self._policies is not None:
                return
            self._ensure_entry_points()
            backends: dict[str, BackendInfo] = {}
            codecs: dict[str, CodecInfo] = {}
            # Call each implementation separately so every registration is attributed
            # to the plugin (and distribution) that made it. Later-registered plugins
            # come first in pluggy's order; iterate in registration order instead.
            for impl in reversed(self._pm.hook.register_backends.get_hookimpls()):
                origin = self._origins.get(impl.plugin_name, Origin(impl.plugin_name, "?", "?"))

                def reg_backend(name: str, factory: BackendFactory, *, description: str = "", _o: Origin = origin) -> None:
                    if not isinstance(name, str) or not name.isidentifier():
                        raise ValueError(f"plugin {_o.plugin}: backend name {name!r} must be an identifier")
                    if name in backends:
                        prev = backends[name].origin
                        log.warning("backend %r from %s overrides the one from %s", name, _o.distribution, prev.distribution)
                    backends[name] = BackendInfo(name, factory, _o, description)

                self._call_impl(impl, reg_backend)
            for impl in reversed(self._pm.hook.register_codecs.get_hookimpls()):
                origin = self._origins.get(impl.plugin_name, Origin(impl.plugin_name, "?", "?"))

                def reg_codec(codec: Codec, *, description: str = "", _o: Origin = origin) -> None:
                    codecs[codec.name] = CodecInfo(codec, _o, description)

                self._call_impl(impl, reg_codec)
            policies: dict[str, PolicyInfo] = {}
            for impl in reversed(self._pm.hook.register_eviction_policies.get_hookimpls()):
                origin = self._origins.get(impl.plugin_name, Origin(impl.plugin_name, "?", "?"))

                def reg_policy(name: str, factory: PolicyFactory, *, description: str = "", _o: Origin = origin) -> None:
                    if not isinstance(name, str) or not name.isidentifier():
                        raise ValueError(f"plugin {_o.plugin}: eviction policy name {name!r} must be an identifier")
                    if name in policies:
                        prev = policies[name].origin
                        log.warning("eviction policy %r from %s overrides the one from %s", name, _o.distribution, prev.distribution)
                    policies[name] = PolicyInfo(name, factory, _o, description)

                self._call_impl(impl, reg_policy)
            self._backends, self._codecs, self._policies = backends, codecs, policies

    def _call_impl(self, impl: pluggy.HookImpl, register: Any) -> None:
        try:
            impl.function(**({"register": register} if "register" in impl.argnames else {}))
        except Exception as err:
            origin = self._origins.get(impl.plugin_name)
            dist = origin.distribution if origin else "?"
            msg = f"plugin {impl.plugin_name!r} from distribution {dist} failed to register: {type(err).__name__}: {err}"
            self.load_errors.append(msg)
            log.warning(msg)

    def backends(self) -> dict[str, BackendInfo]:
        self._collect()
        assert self._backends is not None
        return dict(self._backends)

    def codecs(self) -> dict[str, CodecInfo]:
        self._collect()
        assert self._codecs is not None
        return dict(self._codecs)

    def eviction_policies(self) -> dict[str, PolicyInfo]:
        self._collect()
        assert self._policies is not None
        return dict(self._policies)

    def create_eviction_policy(self, name: str, capacity: int, *, key_path: str, source: str) -> EvictionPolicy:
        """A new policy instance for a tier of ``capacity`` bytes; an unknown name is a
        :class:`ConfigError` naming ``key_path`` and the installed policies."""
        policies = self.eviction_policies()
        info = policies.get(name)
        if info is None:
            raise ConfigError(
                f"{key_path}: unknown eviction policy {name!r} (from {source}); "
                f"installed policies: {', '.join(sorted(policies))}"
            )
        policy = info.factory(capacity)
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(
                f"eviction policy factory for {name!r} from {info.origin.distribution} returned "
                f"{type(policy).__name__}, not an EvictionPolicy"
            )
        return policy

    def codec_map(self) -> dict[str, Codec]:
        return {name: info.codec for name, info in self.codecs().items()}

    def get_codec(self, name: str, *, key_path: str = "serde", source: str = "config") -> Codec:
        codecs = self.codecs()
        if name not in codecs:
            raise ConfigError(
                f"{key_path}: unknown codec {name!r} (from {source}); installed codecs: {', '.join(sorted(codecs))}"
            )
        return codecs[name].codec

    def create_backend(self, section: BackendSection, ctx: BackendContext) -> StorageBackend:
        backends = self.backends()
        info = backends.get(section.name)
        if info is None:
            hint = ""
            if section.name in KNOWN_BACKENDS:
                hint = f"; install it with: pip install '{KNOWN_BACKENDS[section.name]}'"
            elif self.load_errors:
                hint = "; plugins that failed to load: " + "; ".join(self.load_errors)
            raise ConfigError(
                f"{ctx.key_path}.name: unknown backend {section.name!r} (from {ctx.source}); "
                f"installed backends: {', '.join(sorted(backends))}{hint}"
            )
        backend = info.factory(section.options(), ctx)
        if not isinstance(backend, StorageBackend):
            raise TypeError(
                f"backend factory for {section.name!r} from {info.origin.distribution} returned "
                f"{type(backend).__name__}, not a StorageBackend"
            )
        return backend


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
        return _default
