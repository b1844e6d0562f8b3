"""Entry point ``peer`` in the group ``lmcache_core.backends``: the ``peer`` tier and
the ``lmcache-core serve`` and ``lmcache-core admin`` commands, all by dotted path
(imported on first use)."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterBackend, RegisterCommand, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "peer",
        "lmcache_backend_peer.factory:create_peer_backend",
        description="share chunks between instances over authenticated TCP",
    )


@hookimpl
def register_commands(register: RegisterCommand) -> None:
    register(
        "serve",
        "lmcache_backend_peer.cli:setup_command",
        help="run a standalone peer cache node (shared cache for several instances)",
    )
    register(
        "admin",
        "lmcache_backend_peer.admin_cli:setup_command",
        help="a cache node's admin API from the command line (status, lookup, erase)",
    )
