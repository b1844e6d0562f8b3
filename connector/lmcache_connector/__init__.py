"""vLLM v1 KV connector for lmcache-core.

The connector (``connector``) and its two sides (``scheduler``, ``worker``) are at the
top with the settings (``options``); the parts are sub-packages: ``protocol`` (what
crosses vLLM's process boundaries), ``layouts`` (vLLM's KV caches as the connector
sees them), ``transfers`` (moving chunks between them and the cache), ``features``
(hits, load policy, sub-chunk hits, CPU cores) and ``dev`` (the demo, small models).

``LMCacheCoreConnector`` is imported lazily, so tools that only need the helpers
(e.g. :mod:`lmcache_connector.dev.tiny_model`) do not import vLLM.
"""

from typing import Any

__all__ = ["LMCacheCoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "LMCacheCoreConnector":
        from .connector import LMCacheCoreConnector

        return LMCacheCoreConnector
    raise AttributeError(name)
