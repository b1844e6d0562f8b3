"""Typed pluggy hook specs. Plugins never see the plugin manager: they get a
``register`` callback, so the core owns naming and validation and hook signatures can
grow (new keyword arguments) without breaking plugins.

A plugin module looks like::

    from lmcache_core.hookspecs import hookimpl

    @hookimpl
    def register_backends(register):
        register("mytier", create_mytier)   # create_mytier(section, ctx) -> StorageBackend

and is listed in its distribution's entry points under ``lmcache_core.backends``
(the group carries every hook below, not only backends).

Anything heavy a plugin provides (a backend factory, a command) may be registered as
a dotted path ``"package.module:attribute"`` instead of the object: the core imports
it on first use, so listing plugins or choosing one backend imports nothing else.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Mapping, Protocol, Union

import pluggy

from .backend import BackendFactory
from .config import StrictModel
from .eviction import PolicyFactory
from .serde import Codec

PROJECT = "lmcache_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


#: What a command does once its arguments are parsed: returns the exit status.
Command = Callable[[argparse.Namespace], int]
#: Adds a command's arguments to the parser the core made for it, returns the command.
CommandSetup = Callable[[argparse.ArgumentParser], Command]


#: How many bytes of the engine's memory pool a tier keeps chunks in, given its config
#: section (without ``name``), before the tier exists: the engine sizes the pool from it.
PoolBytes = Callable[[Mapping[str, Any]], int]


class RegisterBackend(Protocol):
    def __call__(
        self,
        name: str,
        factory: Union[BackendFactory, str],
        *,
        description: str = "",
        pool_bytes: Union[PoolBytes, str, None] = None,
    ) -> None: ...


class RegisterCommand(Protocol):
    def __call__(self, name: str, setup: Union[CommandSetup, str], *, help: str = "") -> None: ...


class RegisterCodec(Protocol):
    def __call__(self, codec: Codec, *, description: str = "") -> None: ...


class RegisterEvictionPolicy(Protocol):
    def __call__(self, name: str, factory: PolicyFactory, *, description: str = "") -> None: ...


class RegisterConfigSection(Protocol):
    def __call__(self, name: str, model: Union[type[StrictModel], str], *, description: str = "") -> None: ...


class Spec:
    @hookspec
    def register_backends(self, register: RegisterBackend) -> None:
        """Call ``register(name, factory)`` once per storage backend this plugin adds.

        ``factory(section, ctx)`` (or its dotted path) builds the tier. A tier that keeps
        its chunks in the engine's memory pool (zero-copy, like ``local_cpu``) declares
        how much with ``pool_bytes(section) -> int`` (or its dotted path); the engine
        sizes the pool to the sum of the declarations of the configured tiers plus
        ``staging_size``. Tiers that declare nothing get none of the pool beyond the
        staging headroom every tier shares."""

    @hookspec
    def register_commands(self, register: RegisterCommand) -> None:
        """Call ``register(name, setup, help=...)`` once per ``lmcache-core`` subcommand
        this plugin adds. ``setup(parser)`` adds the command's arguments to the
        :class:`argparse.ArgumentParser` the core made for it and returns the command
        (``args -> exit status``). It runs only when that command is invoked, so
        ``setup`` (best given as a dotted path) may import heavy things."""

    @hookspec
    def register_codecs(self, register: RegisterCodec) -> None:
        """Call ``register(codec)`` once per serde codec this plugin adds."""

    @hookspec
    def register_config_sections(self, register: RegisterConfigSection) -> None:
        """Call ``register(name, model, description=...)`` once per top-level section
        this plugin reads from the config (the vLLM connector: ``connector``).
        ``model`` (a :class:`~lmcache_core.config.StrictModel` class, or its dotted
        path, imported when a config is loaded with the section) validates it; its keys
        merge one by one across sources (file, ``LMCACHE_CORE_<NAME>_<KEY>`` env vars,
        overrides) and ``lmcache-core config`` shows them. The core never reads them:
        the plugin gets them as ``loaded.config.<name>`` from a config loaded with
        ``PluginManager.config_model()`` (or its own model with the section)."""

    @hookspec
    def register_eviction_policies(self, register: RegisterEvictionPolicy) -> None:
        """Call ``register(name, factory)`` once per eviction policy this plugin adds;
        ``factory(capacity_bytes)`` returns an :class:`~lmcache_core.eviction.EvictionPolicy`.
        Tiers select it with ``eviction: <name>``."""
