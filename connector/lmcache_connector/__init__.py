"""vLLM v1 KV connector for lmcache-core.

``LMCacheCoreConnector`` is imported lazily, so tools that only need the helpers
(e.g. :mod:`lmcache_connector.tiny_model`) do not import vLLM.
"""

from typing import Any

__all__ = ["LMCacheCoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "LMCacheCoreConnector":
        from .connector import LMCacheCoreConnector

        return LMCacheCoreConnector
    raise AttributeError(name)
