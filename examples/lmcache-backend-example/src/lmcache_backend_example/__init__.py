"""An example lmcache-core storage backend: serialized frames in a dict."""

from .backend import DictBackend, DictBackendConfig, create_dict_backend

__all__ = ["DictBackend", "DictBackendConfig", "create_dict_backend"]
