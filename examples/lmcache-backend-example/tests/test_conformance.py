"""How a backend author runs lmcache-core's conformance suite: subclass it."""

from pathlib import Path

from lmcache_backend_example import DictBackend
from lmcache_core.backend import BackendContext
from lmcache_core.testing import BackendConformance


class TestDictBackend(BackendConformance):
    def make_backend(self, ctx: BackendContext, tmp_path: Path) -> DictBackend:
        return DictBackend(ctx.codec, ctx.codecs, max_entries=1000)
