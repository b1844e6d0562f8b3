"""The plugin module named by the entry point. It only registers, naming the factory
by dotted path: importing it does no work, and the backend module is imported only
when a config selects ``example_dict``, so a broken dependency cannot slow down or
break lmcache-core."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "example_dict",
        "lmcache_backend_example.backend:create_dict_backend",
        description="example: serialized frames in a dict",
    )
