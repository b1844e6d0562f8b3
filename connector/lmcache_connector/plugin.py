"""Entry point ``connector`` in the group ``lmcache_core.backends``: the
``lmcache-core demo`` and ``warm`` commands, by dotted path (nothing of vLLM is imported until the
demo runs), and the ``connector:`` section of the config (:mod:`lmcache_connector.settings`,
which imports nothing of vLLM either)."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterCommand, RegisterConfigSection, hookimpl

from .settings import SECTION_DESCRIPTION, ConnectorSection


@hookimpl
def register_config_sections(register: RegisterConfigSection) -> None:
    register("connector", ConnectorSection, description=SECTION_DESCRIPTION)


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
