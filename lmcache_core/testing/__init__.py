"""Test helpers for backend authors, shipped inside the package.

Subclass :class:`BackendConformance` in your own test suite and implement
``make_backend``; pytest then runs the whole contract against your backend::

    from lmcache_core.testing import BackendConformance

    class TestMyTier(BackendConformance):
        def make_backend(self, ctx, tmp_path):
            return MyTier(...)

Eviction policies have their own suite, :class:`EvictionPolicyConformance`
(implement ``make_policy(capacity)``).
"""

from .conformance import BackendConformance, make_context, random_chunk, random_key
from .policies import EvictionPolicyConformance

__all__ = ["BackendConformance", "EvictionPolicyConformance", "make_context", "random_chunk", "random_key"]
