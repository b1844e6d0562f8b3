"""Entry point ``connector`` in the group ``lmcache_core.backends``: the
``lmcache-core demo``, ``warm`` and ``lookup`` commands, and the ``connector:`` section of the
config (:mod:`lmcache_connector.settings`), all by dotted path: listing plugins
imports nothing else of the connector, and nothing of vLLM is imported until the demo
runs."""

from __future__ import annotations

from lmcache_core.hookspecs import RegisterCommand, RegisterConfigSection, hookimpl

#: the ``connector:`` section's description, in ``lmcache-core config`` and the config's model
SECTION_DESCRIPTION = "the connector's policy: what it saves and loads, and how (merged key by key across sources)"


@hookimpl
def register_config_sections(register: RegisterConfigSection) -> None:
    register("connector", "lmcache_connector.settings:ConnectorSection", description=SECTION_DESCRIPTION)


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
    register(
        "lookup",
        "lmcache_connector.lookup_cmd:setup_command",
        help="which tiers of a config hold how many chunks of some prompts (read-only)",
    )
