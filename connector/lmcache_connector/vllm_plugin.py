"""vLLM general plugin: registers ``LMCacheCoreConnector`` by name, so
``kv_connector_module_path`` can be left out. vLLM runs general plugins in every
process it starts (and may run them twice in one), so registration is idempotent."""

from __future__ import annotations

CONNECTOR_NAME = "LMCacheCoreConnector"
_done = False


def register() -> None:
    global _done
    if _done:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "lmcache_connector.connector", CONNECTOR_NAME)
    except ValueError as err:  # registered already by an earlier call in this process
        if "already registered" not in str(err):
            raise
    _done = True
