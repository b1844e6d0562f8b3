"""An example lmcache-core storage backend: serialized frames in a dict."""

from typing import TYPE_CHECKING

from lmcache_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import DictBackend, DictBackendConfig, create_dict_backend

__all__ = ["DictBackend", "DictBackendConfig", "create_dict_backend"]

# The entry point imports this package whenever plugins load: the backend module is
# imported only when one of these names is first used.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"DictBackend": ".backend", "DictBackendConfig": ".backend", "create_dict_backend": ".backend"},
)
