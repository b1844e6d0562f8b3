"""Connector metrics in vLLM's own ``/metrics``.

vLLM collects ``get_kv_connector_stats()`` from every worker each step, sums them
with :meth:`LMCacheConnectorStats.aggregate`, ships them to its front-end process and
hands them to the connector's :class:`LMCachePromMetrics`, which owns Prometheus
counters registered where vLLM serves ``/metrics``. All names start with
``lmcache_core:``; per-tier counters carry a ``tier`` label.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from lmcache_core.metrics import MEANINGS, PREFIX

# stats key -> (metric name, help); names the core also exports mean the same
# (lmcache_core.metrics.MEANINGS)
COUNTERS = {
    **{
        key: (key, MEANINGS[key])
        for key in ("lookups", "lookup_tokens", "hit_tokens", "loaded_tokens", "load_errors", "bypassed_tokens")
    },
    "saved_tokens": ("saved_tokens", "Tokens saved from vLLM's KV cache"),
    "verified_chunks": ("verified_chunks", MEANINGS["verified_chunks"]),
    "verify_inexact": ("verify_inexact", "Verified chunks equal to their recomputation only within the dtype tolerance"),
    "load_seconds": ("load_seconds", "Time spent loading KV into vLLM"),
    "save_seconds": ("save_seconds", "Time spent saving KV from vLLM"),
    # the scheduler side's (connector.save_decode_cache: prefill)
    "settles": ("settles", "Settles that ran: finished answers whose whole chunks were prefilled once more and stored"),
    "settles_superseded": (
        "settles_superseded",
        "Queued settles dropped because a request needing their chunks came first (it computed them itself)",
    ),
    "settles_dropped": (
        "settles_dropped",
        "Finished answers not settled: past the bound of settles in flight, or their prompt left the cache",
    ),
    "settle_waits": ("settle_waits", "Requests that waited for a running settle storing some of their chunks"),
    "save_waits": ("save_waits", "Requests whose lookup waited a step or more for a background save of their chunks"),
}
# per-tier stats keys are "<kind>/<tier>"
TIER_COUNTERS = {
    "tier_put_bytes": ("tier_put_bytes", "Bytes written per tier"),
    "tier_get_bytes": ("tier_get_bytes", "Bytes read per tier"),
    "tier_errors": ("tier_errors", "Backend failures turned into misses, per tier"),
    "tier_evictions": ("tier_evictions", "Chunks evicted per tier"),
    "tier_retention_kept": ("tier_retention_kept", "Evictions a retention hint prevented, per tier"),
    "verify_mismatches": ("verify_mismatches", MEANINGS["verify_mismatches"]),
}
# per-tier gauges, shipped as deltas (+1 when quarantined, -1 when released; bytes
# held: the change since the last report)
TIER_GAUGES = {
    "tier_quarantined": ("tier_quarantined", MEANINGS["tier_quarantined"]),
    "tier_used_bytes": ("tier_used_bytes", "Bytes a tier holds now (this engine's view; shared tiers count every writer)"),
    "tier_capacity_bytes": ("tier_capacity_bytes", "A tier's byte budget (0: none)"),
    "tier_retained_bytes": ("tier_retained_bytes", "Bytes a tier keeps for retention hints now"),
}


class DeltaReporter:
    """Turns running totals into the increments since the previous report (vLLM sums
    increments across workers and steps)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}  # the totals as last reported

    def delta(self, now: dict[str, float]) -> dict[str, float]:
        """The increments of ``now`` over the last totals of each key (a key missing
        from ``now``, e.g. a tier whose stats failed this step, keeps its last total:
        its next report is an increment, not its whole total again). A per-tier key
        (``kind/tier``) seen for the first time is reported even at 0, so its series
        exists from the tier's first report."""
        last = self.last
        out = {k: v - last.get(k, 0) for k, v in now.items()}
        self.last = {**last, **now}
        return {k: v for k, v in out.items() if v or ("/" in k and k not in last)}


class LMCacheConnectorStats(KVConnectorStats):
    """Counter deltas since the last report: a flat ``{name: number}`` dict."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "LMCacheConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not self.data  # (a 0 is a tier's first report: its series start there)


class LMCachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._per_engine(self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames))
            for key, (name, doc) in COUNTERS.items()
        }
        # vLLM types its metric classes as one union of Gauge/Counter/Histogram
        self._tier_counters: dict[str, Any] = {
            key: self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=[*labelnames, "tier"])
            for key, (name, doc) in TIER_COUNTERS.items()
        }
        self._tier_gauges: dict[str, Any] = {
            key: self._gauge_cls(name=PREFIX + name, documentation=doc, labelnames=[*labelnames, "tier"])
            for key, (name, doc) in TIER_GAUGES.items()
        }
        self._tiers_seen: dict[int, set[str]] = {}

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def _new_tier(self, engine_idx: int, tier: str) -> None:
        """Every per-tier series of ``tier`` exported from the tier's first report, at 0
        until it moves: a dashboard panel or an alert on a tier's errors has a series
        to read before the first error (none silently empty)."""
        values = [*self.per_engine_labelvalues[engine_idx], tier]
        for metric in (*self._tier_counters.values(), *self._tier_gauges.values()):
            metric.labels(*values).inc(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        seen = self._tiers_seen.setdefault(engine_idx, set())
        for key, value in transfer_stats_data.items():
            kind, _, tier = key.partition("/")
            if tier and tier not in seen and (kind in self._tier_counters or kind in self._tier_gauges):
                seen.add(tier)
                self._new_tier(engine_idx, tier)
            if not value:
                continue
            if kind in self._tier_gauges:
                self._tier_gauges[kind].labels(*self.per_engine_labelvalues[engine_idx], tier).inc(value)
                continue
            if value < 0:
                continue
            if key in self._counters:
                self._counters[key][engine_idx].inc(value)
            elif "/" in key:
                kind, tier = key.split("/", 1)
                counter = self._tier_counters.get(kind)
                if counter is not None:
                    counter.labels(*self.per_engine_labelvalues[engine_idx], tier).inc(value)
