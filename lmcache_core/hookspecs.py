"""Typed pluggy hook specs. Plugins never see the plugin manager: they get a
``register`` callback, so the core owns naming and validation and hook signatures can
grow (new keyword arguments) without breaking plugins.

A plugin module looks like::

    from lmcache_core.hookspecs import hookimpl

    @hookimpl
    def register_backends(register):
        register("mytier", create_mytier)   # create_mytier(section, ctx) -> StorageBackend

and is listed in its distribution's entry points under ``lmcache_core.backends``.
"""

from __future__ import annotations

from typing import Protocol

import pluggy

from .backend import BackendFactory
from .eviction import PolicyFactory
from .serde import Codec

PROJECT = "lmcache_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RegisterBackend(Protocol):
    def __call__(self, name: str, factory: BackendFactory, *, description: str = "") -> None: ...


class RegisterCodec(Protocol):
    def __call__(self, codec: Codec, *, description: str = "") -> None: ...


class RegisterEvictionPolicy(Protocol):
    def __call__(self, name: str, factory: PolicyFactory, *, description: str = "") -> None: ...


class Spec:
    @hookspec
    def register_backends(self, register: RegisterBackend) -> None:
        """Call ``register(name, factory)`` once per storage backend this plugin adds."""

    @hookspec
    def register_codecs(self, register: RegisterCodec) -> None:
        """Call ``register(codec)`` once per serde codec this plugin adds."""

    @hookspec
    def register_eviction_policies(self, register: RegisterEvictionPolicy) -> None:
        """Call ``register(name, factory)`` once per eviction policy this plugin adds;
        ``factory(capacity_bytes)`` returns an :class:`~lmcache_core.eviction.EvictionPolicy`.
        Tiers select it with ``eviction: <name>``."""
