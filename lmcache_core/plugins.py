"""Plugin loading and the backend/codec registry.

The rest of the code calls :class:`PluginManager`'s typed methods, never pluggy
hooks directly. Default plugins (CPU tier, built-in codecs) go through the same hooks
as third-party ones. Entry points in the group ``lmcache_core.backends`` load lazily,
each in its own ``try``: a broken plugin is reported with its distribution name and
the others still load. ``LMCACHE_CORE_BLOCK_PLUGINS=name,name`` (entry-point or
distribution names) keeps named plugins out.

Plugins may register a backend factory or a command by dotted path
(``"package.module:attribute"``): :func:`resolve_ref` imports it when the backend is
created or the command runs, so loading the registry imports only the light plugin
modules the entry points name.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import logging
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Union

import pluggy

from .backend import BackendContext, BackendFactory, StorageBackend
from .config import ENV_BLOCK_PLUGINS, BackendSection, ConfigError, CoreConfig, StrictModel, config_model
from .eviction import EvictionPolicy, PolicyFactory
from .hookspecs import PROJECT, Command, CommandSetup, PoolBytes, Spec
from .lazy import check_ref, resolve_ref
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


_COMMAND_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
#: Subcommands of ``lmcache-core`` itself; a plugin cannot take these names.
BUILTIN_COMMANDS = frozenset({"plugins", "config", "quarantine", "replay", "erase"})


@dataclass(frozen=True)
class BackendInfo:
    name: str
    factory: Union[BackendFactory, str]  # a callable, or a dotted path imported on first use
    origin: Origin
    description: str = ""
    #: bytes of the engine's pool the tier keeps chunks in, from its section (a callable
    #: or a dotted path); ``None``: it keeps none
    pool_bytes: Union[PoolBytes, str, None] = None

    def load_factory(self) -> BackendFactory:
        """The factory, importing it now when it was registered by dotted path."""
        if isinstance(self.factory, str):
            factory: BackendFactory = resolve_ref(self.factory)
            return factory
        return self.factory


@dataclass(frozen=True)
class CommandInfo:
    name: str
    setup: Union[CommandSetup, str]  # a callable, or a dotted path imported when the command runs
    origin: Origin
    help: str = ""

    def configure(self, parser: argparse.ArgumentParser) -> Command:
        """Let the plugin add its arguments to ``parser``; returns the command."""
        setup: CommandSetup = resolve_ref(self.setup) if isinstance(self.setup, str) else self.setup
        command = setup(parser)
        if not callable(command):
            raise TypeError(f"command {self.name!r} from {self.origin.distribution}: setup returned {command!r}, not a callable")
        return command


@dataclass(frozen=True)
class SectionInfo:
    name: str
    model: Union[type[StrictModel], str]  # a class, or a dotted path imported on first use
    origin: Origin
    description: str = ""

    def load_model(self) -> type[StrictModel]:
        """The section's model, importing it now when it was registered by dotted path."""
        try:
            model = resolve_ref(self.model) if isinstance(self.model, str) else self.model
        except (ImportError, AttributeError) as err:
            raise PluginError(
                f"config section {self.name!r} from {self.origin.distribution} {self.origin.version} failed to load: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not (isinstance(model, type) and issubclass(model, StrictModel)):
            raise PluginError(
                f"config section {self.name!r} from {self.origin.distribution}: {model!r} is not a StrictModel class"
            )
        return model


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


def _put(table: dict[str, Any], kind: str, info: Any) -> None:
    """``table[info.name] = info``; a later plugin overriding an earlier one's name is
    logged with both distributions."""
    prev = table.get(info.name)
    if prev is not None:
        log.warning(
            "%s %r from %s overrides the one from %s", kind, info.name, info.origin.distribution, prev.origin.distribution
        )
    table[info.name] = info


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


_NAMES_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]*: ")


def _under(key_path: str, message: str) -> str:
    """``message`` placed under ``key_path``: ``"max_size: bad"`` becomes
    ``"backends[0].max_size: bad"``; a message that names no key follows a colon."""
    return f"{key_path}.{message}" if _NAMES_KEY.match(message) else f"{key_path}: {message}"


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
        self._commands: dict[str, CommandInfo] | None = None
        self._sections: dict[str, SectionInfo] | None = None
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
            self._backends = self._codecs = self._policies = self._commands = self._sections = None

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
            self._backends = self._codecs = self._policies = self._commands = self._sections = None

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
            if (
                self._backends is not None
                and self._codecs is not None
                and self._policies is not None
                and self._commands is not None
                and self._sections is not None
            ):
                return
            self._ensure_entry_points()
            backends, codecs = self._collect_backends(), self._collect_codecs()
            policies, commands = self._collect_policies(), self._collect_commands()
            self._sections = self._collect_sections()
            self._backends, self._codecs, self._policies, self._commands = backends, codecs, policies, commands

    def _impls(self, hook: pluggy.HookCaller) -> Iterator[tuple[pluggy.HookImpl, Origin]]:
        """``hook``'s implementations in registration order, each with its plugin's
        origin. Each is called on its own, so every registration is attributed to the
        plugin (and distribution) that made it; pluggy's own order puts the
        later-registered plugins first."""
        for impl in reversed(hook.get_hookimpls()):
            yield impl, self._origins.get(impl.plugin_name, Origin(impl.plugin_name, "?", "?"))

    def _collect_backends(self) -> dict[str, BackendInfo]:
        backends: dict[str, BackendInfo] = {}
        for impl, origin in self._impls(self._pm.hook.register_backends):

            def reg_backend(
                name: str,
                factory: Union[BackendFactory, str],
                *,
                description: str = "",
                pool_bytes: Union[PoolBytes, str, None] = None,
                _o: Origin = origin,
            ) -> None:
                if not isinstance(name, str) or not name.isidentifier():
                    raise ValueError(f"plugin {_o.plugin}: backend name {name!r} must be an identifier")
                for what, ref in (("factory", factory), ("pool_bytes", pool_bytes)):
                    if isinstance(ref, str):
                        check_ref(ref)
                    elif not callable(ref) and not (what == "pool_bytes" and ref is None):
                        raise ValueError(
                            f"plugin {_o.plugin}: backend {name!r}: {what} {ref!r} is neither callable nor a dotted path"
                        )
                _put(backends, "backend", BackendInfo(name, factory, _o, description, pool_bytes))

            self._call_impl(impl, reg_backend)
        return backends

    def _collect_codecs(self) -> dict[str, CodecInfo]:
        codecs: dict[str, CodecInfo] = {}
        for impl, origin in self._impls(self._pm.hook.register_codecs):

            def reg_codec(codec: Codec, *, description: str = "", _o: Origin = origin) -> None:
                codecs[codec.name] = CodecInfo(codec, _o, description)

            self._call_impl(impl, reg_codec)
        return codecs

    def _collect_policies(self) -> dict[str, PolicyInfo]:
        policies: dict[str, PolicyInfo] = {}
        for impl, origin in self._impls(self._pm.hook.register_eviction_policies):

            def reg_policy(name: str, factory: PolicyFactory, *, description: str = "", _o: Origin = origin) -> None:
                if not isinstance(name, str) or not name.isidentifier():
                    raise ValueError(f"plugin {_o.plugin}: eviction policy name {name!r} must be an identifier")
                _put(policies, "eviction policy", PolicyInfo(name, factory, _o, description))

            self._call_impl(impl, reg_policy)
        return policies

    def _collect_commands(self) -> dict[str, CommandInfo]:
        commands: dict[str, CommandInfo] = {}
        for impl, origin in self._impls(self._pm.hook.register_commands):

            def reg_command(name: str, setup: Union[CommandSetup, str], *, help: str = "", _o: Origin = origin) -> None:
                if not isinstance(name, str) or not _COMMAND_NAME.match(name):
                    raise ValueError(f"plugin {_o.plugin}: command name {name!r} must be lower-case letters, digits and '-'")
                if name in BUILTIN_COMMANDS:
                    raise ValueError(f"plugin {_o.plugin}: command name {name!r} is taken by lmcache-core itself")
                if isinstance(setup, str):
                    check_ref(setup)
                elif not callable(setup):
                    raise ValueError(
                        f"plugin {_o.plugin}: command {name!r}: setup {setup!r} is neither callable nor a dotted path"
                    )
                _put(commands, "command", CommandInfo(name, setup, _o, help))

            self._call_impl(impl, reg_command)
        return commands

    def _collect_sections(self) -> dict[str, SectionInfo]:
        sections: dict[str, SectionInfo] = {}
        for impl, origin in self._impls(self._pm.hook.register_config_sections):

            def reg_section(
                name: str, model: Union[type[StrictModel], str], *, description: str = "", _o: Origin = origin
            ) -> None:
                if not isinstance(name, str) or not name.isidentifier() or "_" in name:
                    raise ValueError(f"plugin {_o.plugin}: config section name {name!r} must be a word (letters, digits)")
                if name in CoreConfig.model_fields:
                    raise ValueError(f"plugin {_o.plugin}: config section {name!r} is a key of lmcache-core itself")
                if isinstance(model, str):
                    check_ref(model)
                elif not (isinstance(model, type) and issubclass(model, StrictModel)):
                    raise ValueError(f"plugin {_o.plugin}: config section {name!r}: {model!r} is not a StrictModel class")
                _put(sections, "config section", SectionInfo(name, model, _o, description))

            self._call_impl(impl, reg_section)
        return sections

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

    def commands(self) -> dict[str, CommandInfo]:
        """``lmcache-core`` subcommands added by plugins (the built-in ones excluded)."""
        self._collect()
        assert self._commands is not None
        return dict(self._commands)

    def config_sections(self) -> dict[str, SectionInfo]:
        """Top-level config sections plugins add (the vLLM connector's ``connector``)."""
        self._collect()
        assert self._sections is not None
        return dict(self._sections)

    def config_model(self) -> type[CoreConfig]:
        """The config's model with the installed plugins' sections: what
        :func:`~lmcache_core.config.load_config` takes as ``model`` wherever a user's
        config is read (``lmcache-core config``, ``erase``, ``replay``)."""
        return config_model({n: (s.load_model(), s.description) for n, s in self.config_sections().items()})

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
                f"{key_path}: unknown eviction policy {name!r} (from {source}); installed policies: {', '.join(sorted(policies))}"
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

    def pool_bytes(self, section: BackendSection, *, key_path: str = "backends", source: str = "config") -> int:
        """The bytes of the engine's pool the tier ``section`` (at ``key_path``, read from
        ``source``) declares it keeps chunks in (0: none, or an unknown backend).

        A size that does not parse is a :class:`ConfigError` naming the key and the value
        (never 0: the pool would silently lose the tier's whole budget)."""
        info = self.backends().get(section.name)
        if info is None or info.pool_bytes is None:
            return 0
        declare: PoolBytes = resolve_ref(info.pool_bytes) if isinstance(info.pool_bytes, str) else info.pool_bytes
        try:
            return max(0, int(declare(section.options())))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{_under(key_path, str(err))} (backend {section.name!r}, from {source})") from None

    def backend_info(self, name: str, *, key_path: str, source: str) -> BackendInfo:
        """The installed backend ``name``; an unknown one is a :class:`ConfigError`
        naming ``key_path``, the installed backends and how to get it."""
        backends = self.backends()
        info = backends.get(name)
        if info is None:
            hint = ""
            if name in KNOWN_BACKENDS:
                hint = f"; install it with: pip install '{KNOWN_BACKENDS[name]}'"
            elif self.load_errors:
                hint = "; plugins that failed to load: " + "; ".join(self.load_errors)
            raise ConfigError(
                f"{key_path}.name: unknown backend {name!r} (from {source}); "
                f"installed backends: {', '.join(sorted(backends))}{hint}"
            )
        return info

    def create_backend(self, section: BackendSection, ctx: BackendContext) -> StorageBackend:
        info = self.backend_info(section.name, key_path=ctx.key_path, source=ctx.source)
        try:
            factory = info.load_factory()
        except (ImportError, AttributeError) as err:
            raise PluginError(
                f"{ctx.key_path}.name: backend {section.name!r} from {info.origin.distribution} "
                f"{info.origin.version} failed to load: {type(err).__name__}: {err}"
            ) from err
        backend = factory(section.options(), ctx)
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
