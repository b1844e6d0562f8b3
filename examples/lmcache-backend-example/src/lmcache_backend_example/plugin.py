"""The plugin module named by the entry point. It only registers; importing it
does no work, so a broken dependency cannot slow down or break lmcache-core."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    from .backend import create_dict_backend

    register("example_dict", create_dict_backend, description="example: serialized frames in a dict")
