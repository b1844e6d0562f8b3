"""Entry point ``connector`` in the group ``lmcache_core.backends``: the
``lmcache-core demo`` and ``warm`` commands, by dotted path (nothing of vLLM is imported until the
demo runs)."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterCommand, hookimpl


@hookimpl
def register_commands(register: RegisterCommand) -> None:
    register(
        "demo",
        "lmcache_connector.dev.demo:setup_command",
        help="end-to-end demo on real vLLM: cold vs warm time to first token",
    )
    register(
        "warm",
        "lmcache_connector.warm:setup_command",
        help="prefill a corpus into the tiers of a config, so a server started later hits at once",
    )
