"""The engine sizes its memory pool from what the configured tiers declare
(``pool_bytes`` at registration), never from a backend's name: a third-party zero-copy
tier, installed as a distribution with an entry point, gets the pool it declares."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from lmcache_core import CacheEngine, KeyNamespace, load_config
from lmcache_core.config import BackendSection, ConfigError
from lmcache_core.plugins import PluginManager
from lmcache_core.testing.tokens import retrieve_tokens, store_tokens

from .helpers import make_distribution

# A zero-copy tier as a third party would write it: chunks stay in the engine's pool
# (put_buffer adopts the buffer), a byte budget, nothing ever evicted.
# Not the reference tier: it must be installed as a distribution's own code and be
# zero-copy, which the reference tier is not.
ZERO_COPY_TIER_SRC = """
import threading
from lmcache_core.backend import ZERO_COPY, BackendStats, StorageBackend, prefix_count
from lmcache_core.config import parse_size
from lmcache_core.hookspecs import hookimpl


class PoolTier(StorageBackend):
    name = "pool_tier"
    capabilities = frozenset({ZERO_COPY})

    def __init__(self, pool, max_size):
        self.pool, self.max_size, self.bufs, self.used = pool, max_size, {}, 0
        self.lock = threading.Lock()

    def contains(self, keys):
        with self.lock:
            return prefix_count(keys, self.bufs)

    def put(self, key, data):
        buf = self.pool.allocate(tuple(data.shape), data.dtype)
        if buf is None:
            return False
        buf.tensor.copy_(data)
        try:
            return self.put_buffer(key, buf)
        finally:
            buf.release()

    def put_buffer(self, key, buf):
        with self.lock:
            if key in self.bufs or self.used + buf.nbytes > self.max_size:
                return False
            self.bufs[key] = buf.retain()
            self.used += buf.nbytes
            return True

    def get(self, key, out):
        with self.lock:
            buf = self.bufs.get(key)
            if buf is None or buf.tensor.shape != out.shape or buf.tensor.dtype != out.dtype:
                return False
            out.copy_(buf.tensor)
            return True

    def get_buffer(self, key):
        with self.lock:
            buf = self.bufs.get(key)
            return None if buf is None else buf.retain()

    def evict_for(self, nbytes):
        return 0

    def remove(self, key):
        with self.lock:
            buf = self.bufs.pop(key, None)
        if buf is None:
            return False
        self.used -= buf.nbytes
        buf.release()
        return True

    def stats(self):
        with self.lock:
            return BackendStats(self.name, chunks=len(self.bufs), bytes_used=self.used, bytes_capacity=self.max_size)

    def close(self):
        for key in list(self.bufs):
            self.remove(key)


def create(section, ctx):
    return PoolTier(ctx.pool, parse_size(section.get("max_size", "8MiB")))


def pool_bytes(section):
    return parse_size(section.get("max_size", "8MiB"))


@hookimpl
def register_backends(register):
    register("pool_tier", "{mod}:create", pool_bytes="{mod}:pool_bytes", description="zero-copy, declares its pool")
    register("pool_tier_undeclared", "{mod}:create", description="zero-copy, declares nothing")
"""

CHUNK = 256 << 10  # bytes per chunk
TIER = 8 << 20
STAGING = 1 << 20


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> PluginManager:
    root = tmp_path_factory.mktemp("zc-dist")
    mod = f"zc_tier_{uuid.uuid4().hex[:8]}"
    make_distribution(root, "zero-copy-tier", "1.0", {"zc": mod}, {mod: ZERO_COPY_TIER_SRC.replace("{mod}", mod)})
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    pm = PluginManager(env={})
    pm.backends()  # load the entry points while the distribution is on sys.path
    mp.undo()
    assert pm.backends()["pool_tier"].origin.distribution == "zero-copy-tier"
    return pm


def _fill(engine: CacheEngine, n: int) -> int:
    """Store ``n`` distinct single-chunk prompts of CHUNK bytes; how many the tier took."""
    stored = 0
    for i in range(n):
        tokens = [i * 100 + t for t in range(engine.chunk_size)]
        stored += store_tokens(engine, tokens, [torch.full((CHUNK // 4,), float(i))])
    return stored


@pytest.mark.parametrize("name", ["pool_tier", "pool_tier_undeclared"])
def test_third_party_zero_copy_tier_gets_the_pool_it_declares(
    name: str, plugins: PluginManager, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(
        env={},
        overrides={
            "chunk_size": 16,
            "staging_size": STAGING,
            "backends": [{"name": name, "max_size": TIER}],
        },
    )
    with caplog.at_level(logging.WARNING, logger="lmcache_core.engine"):
        engine = CacheEngine(cfg, namespace=KeyNamespace(model="zc"), plugins=plugins)
    with engine:
        wanted = TIER // CHUNK
        stored = _fill(engine, wanted)
        if name == "pool_tier":
            assert engine.pool.capacity == TIER + STAGING
            assert stored == wanted  # the whole budget lives in the pool
            assert engine.stats()["tiers"][0]["bytes_used"] == TIER
            out = torch.empty(CHUNK // 4)
            assert retrieve_tokens(engine, [3 * 100 + t for t in range(16)], [out]) == 1 and out[0].item() == 3.0
            assert "declares no pool_bytes" not in caplog.text
        else:
            # Negative control: without a declaration only the staging headroom exists.
            assert engine.pool.capacity == STAGING
            assert stored == STAGING // CHUNK < wanted
            assert "backends[0] (pool_tier_undeclared) keeps chunks in the memory pool but declares no pool_bytes" in caplog.text


def test_local_cpu_declares_its_max_size(plugins: PluginManager) -> None:
    """The core's own CPU tier sizes the pool through the same declaration; a size
    that does not parse is reported with its key before the pool is built."""
    cfg = load_config(env={}, overrides={"staging_size": STAGING, "backends": [{"name": "local_cpu", "max_size": "3MiB"}]})
    with CacheEngine(cfg, namespace=KeyNamespace(model="cpu"), plugins=plugins) as engine:
        assert engine.pool.capacity == (3 << 20) + STAGING
    bad = load_config(env={}, overrides={"backends": [{"name": "local_cpu", "max_size": "lots"}]})
    with pytest.raises(ValueError, match=r"backends\[0\]\.max_size"):
        CacheEngine(bad, namespace=KeyNamespace(model="cpu"), plugins=plugins)


def test_a_declared_size_that_does_not_parse_is_a_config_error(plugins: PluginManager) -> None:
    """A pool size that does not parse is a ConfigError naming the key, the value and
    the file, never 0 bytes: counted as 0, the pool was built without the tier's
    budget, and a third-party tier whose factory parses the size differently (or not
    at all) started with no pool behind it."""
    bad = BackendSection(name="local_cpu", max_size="12XB")
    with pytest.raises(ConfigError, match=r"^backends\.max_size: .*'12XB'.*'local_cpu'"):
        plugins.pool_bytes(bad)
    with pytest.raises(ConfigError, match=r"^backends\[1\]\.max_size: .*'12XB' \(backend 'local_cpu', from lmcache\.yaml\)$"):
        plugins.pool_bytes(bad, key_path="backends[1]", source="lmcache.yaml")
    # A third-party declaration whose error names no key still names the entry and value.
    with pytest.raises(ConfigError, match=r"^backends\[0\]: expected a size .*'12XB' \(backend 'pool_tier', from f\)$"):
        plugins.pool_bytes(BackendSection(name="pool_tier", max_size="12XB"), key_path="backends[0]", source="f")
    # Through the engine: the error comes before any pool or tier exists.
    cfg = load_config(env={}, overrides={"backends": [{"name": "pool_tier", "max_size": "12XB"}]})
    with pytest.raises(ConfigError, match=r"^backends\[0\]: .*'12XB' \(backend 'pool_tier', from programmatic override\)$"):
        CacheEngine(cfg, namespace=KeyNamespace(model="zc"), plugins=plugins)
    # Controls: sizes that parse are declared as written; a tier that declares nothing
    # (or an unknown name) claims none of the pool.
    assert plugins.pool_bytes(BackendSection(name="local_cpu", max_size="12MB")) == 12_000_000
    assert plugins.pool_bytes(BackendSection(name="pool_tier", max_size="12KiB")) == 12 << 10
    assert plugins.pool_bytes(BackendSection(name="pool_tier_undeclared", max_size="12XB")) == 0
    assert plugins.pool_bytes(BackendSection(name="no_such_tier", max_size="12XB")) == 0
