"""Prometheus metrics, all prefixed ``lmcache_core:`` (the convention vLLM uses for
its own ``vllm:`` metrics, so they sit side by side in ``/metrics``).

The metrics here live in the process that runs the cache engine, in their own
registry :data:`REGISTRY` (serve it with
``prometheus_client.start_http_server(port, registry=REGISTRY)``). Under vLLM the
connector also ships per-step counters to vLLM's front end, which exports them in
its own ``/metrics`` (see docs/connector.md); a separate registry keeps the
two from colliding when they share a process. Every engine also keeps plain counters
(:class:`EngineCounters`) for tests and the CLI.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "lmcache_core:"
REGISTRY = CollectorRegistry()

#: One name, one meaning: what each counter shared with the connector's stats (vLLM's
#: ``/metrics``) counts. The connector takes its help texts from here, and the engine
#: counts each in one place (:meth:`CacheEngine.record_lookup`,
#: :meth:`CacheEngine.record_load_errors`), so both exports agree.
MEANINGS = {
    "lookups": "Prefix lookups answered by the cache engine (one per request lookup)",
    "lookup_tokens": "Tokens of the chunks looked up",
    "hit_tokens": "Tokens of the chunks found by lookups",
    "loaded_tokens": "Tokens loaded from the cache into the serving engine's KV cache",
    "load_errors": "Chunks that were found but failed to load, and were recomputed",
    "bypassed_tokens": "Cached tokens recomputed because loading them was predicted slower (load_policy)",
    "stored_tokens": "Tokens stored into the cache",
    "verified_chunks": "Cached chunks recomputed and compared with the cache (correctness canary)",
    "verify_mismatches": "Stored chunks that differed from their recomputation, per tier charged (correctness canary)",
    "tier_quarantined": "1 while a tier is quarantined (no reads, no writes) after verification mismatches; summed over tensor-parallel ranks",
}

LOOKUPS = Counter(PREFIX + "lookups", MEANINGS["lookups"], registry=REGISTRY)
LOOKUP_TOKENS = Counter(PREFIX + "lookup_tokens", MEANINGS["lookup_tokens"], registry=REGISTRY)
HIT_TOKENS = Counter(PREFIX + "hit_tokens", MEANINGS["hit_tokens"], registry=REGISTRY)
STORED_TOKENS = Counter(PREFIX + "stored_tokens", MEANINGS["stored_tokens"], registry=REGISTRY)
LOADED_TOKENS = Counter(PREFIX + "loaded_tokens", MEANINGS["loaded_tokens"], registry=REGISTRY)
BYPASSED_TOKENS = Counter(PREFIX + "bypassed_tokens", MEANINGS["bypassed_tokens"], registry=REGISTRY)
LOAD_ERRORS = Counter(PREFIX + "load_errors", MEANINGS["load_errors"], registry=REGISTRY)
TIER_BYTES = Counter(PREFIX + "tier_bytes", "Bytes moved per tier", ["tier", "op"], registry=REGISTRY)
TIER_ERRORS = Counter(PREFIX + "tier_errors", "Backend failures turned into misses", ["tier", "op"], registry=REGISTRY)
TIER_DROPPED = Counter(
    PREFIX + "tier_dropped_writes", "Background writes dropped (queue full or skipped)", ["tier"], registry=REGISTRY
)
VERIFIED_CHUNKS = Counter(PREFIX + "verified_chunks", MEANINGS["verified_chunks"], registry=REGISTRY)
VERIFY_MISMATCHES = Counter(PREFIX + "verify_mismatches", MEANINGS["verify_mismatches"], ["tier"], registry=REGISTRY)
TIER_QUARANTINED = Gauge(PREFIX + "tier_quarantined", MEANINGS["tier_quarantined"], ["tier"], registry=REGISTRY)
TIER_LATENCY = Histogram(
    PREFIX + "tier_latency_seconds",
    "Latency of one backend call; tier 'connector', op 'load_request': one request's whole load",
    ["tier", "op"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
    registry=REGISTRY,
)


_CHILDREN: dict[tuple[Any, tuple[str, ...]], Any] = {}


def labeled(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, cached: ``labels()`` validates and locks on every
    call, a few microseconds on each store and read of a chunk."""
    child = _CHILDREN.get((metric, values))
    if child is None:
        child = _CHILDREN[(metric, values)] = metric.labels(*values)
    return child


@dataclass
class EngineCounters:
    """Plain counters of one engine; the shared names mean what :data:`MEANINGS` says."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    stored_chunks: int = 0
    stored_tokens: int = 0
    retrieved_chunks: int = 0
    prefetches: int = 0
    load_errors: int = 0
    dropped_writes: int = 0
    verified_chunks: int = 0
    verify_mismatches: dict[str, int] = field(default_factory=dict)
    backend_errors: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, tier: str) -> None:
        with self._lock:
            self.backend_errors[tier] = self.backend_errors.get(tier, 0) + 1

    def mismatch(self, tier: str) -> None:
        with self._lock:
            self.verify_mismatches[tier] = self.verify_mismatches.get(tier, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
            d["backend_errors"] = dict(self.backend_errors)
            d["verify_mismatches"] = dict(self.verify_mismatches)
            return d
