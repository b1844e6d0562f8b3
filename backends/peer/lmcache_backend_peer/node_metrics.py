"""The node's metrics in Prometheus' text format (0.0.4), served by the admin API at
``GET /metrics`` behind the same bearer token (Prometheus: ``authorization:
{credentials_file: ...}`` in the scrape config). Built from the admin API's own
``/status`` answer, so the two never disagree:

* ``lmcache_node_bytes``, ``_max_bytes``, ``_chunks``, ``_evictions_total``,
  ``_retained_chunks``, ``_retained_bytes``: the store;
* ``lmcache_node_keys_total{kind}`` / ``lmcache_node_hits_total{kind}``: keys engines
  asked for and the node held (kind: lookup, get, locate);
* ``lmcache_node_connection_events_total{event}``: the node's connection counters;
* per tenant (a node with ``--tenants-file``; the shared secret's principal is
  ``tenant="(shared secret)"``): ``lmcache_node_tenant_bytes``, ``_chunks``,
  ``_quota_bytes`` (only where a quota is set), ``_refused_total``,
  ``_self_evictions_total``;
* ``lmcache_node_admin_requests_total{outcome}``: the API's own counters.
"""

from __future__ import annotations

from typing import Any, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_STORE = [
    ("bytes", "gauge", "bytes of chunks the node holds", "bytes"),
    ("max_bytes", "gauge", "the node's byte budget (--max-size)", "max_bytes"),
    ("chunks", "gauge", "chunks the node holds", "chunks"),
    ("evictions_total", "counter", "chunks evicted to stay within the budget or a quota", "evictions"),
    ("retained_chunks", "gauge", "chunks retained through eviction now (POST /retain)", "retained"),
    ("retained_bytes", "gauge", "bytes of the chunks retained now", "retained_bytes"),
]
_TENANT = [
    ("bytes", "gauge", "bytes of chunks this tenant wrote, held now", "bytes"),
    ("chunks", "gauge", "chunks this tenant wrote, held now", "chunks"),
    ("quota_bytes", "gauge", "this tenant's quota (absent: none)", "quota"),
    ("refused_total", "counter", "puts refused over the quota", "refused"),
    ("self_evictions_total", "counter", "own chunks evicted to stay within the quota", "self_evictions"),
]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, text: str, samples: Iterable[tuple[str, Any]]) -> list[str]:
    rows = [f"{name}{labels} {value}" for labels, value in samples if isinstance(value, (int, float))]
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *rows] if rows else []


def render(status: dict[str, Any]) -> str:
    """The exposition text of one ``/status`` answer."""
    tier = status["tiers"][0]
    out: list[str] = []
    for suffix, kind, text, field in _STORE:
        out += _family(f"lmcache_node_{suffix}", kind, text, [("", tier.get(field))])
    hits = status["hits"]
    out += _family(
        "lmcache_node_keys_total", "counter", "keys engines asked for", [(f'{{kind="{k}"}}', v["keys"]) for k, v in hits.items()]
    )
    out += _family(
        "lmcache_node_hits_total",
        "counter",
        "keys asked for that the node held",
        [(f'{{kind="{k}"}}', v["hits"]) for k, v in hits.items()],
    )
    out += _family(
        "lmcache_node_connection_events_total",
        "counter",
        "the node's connection counters",
        [(f'{{event="{_label(k)}"}}', v) for k, v in sorted(status["connections"].items())],
    )
    tenants = status.get("tenants") or {}
    for suffix, kind, text, field in _TENANT:
        out += _family(
            f"lmcache_node_tenant_{suffix}",
            kind,
            text,
            [(f'{{tenant="{_label(t)}"}}', row.get(field)) for t, row in sorted(tenants.items())],
        )
    admin = status["admin"]
    out += _family(
        "lmcache_node_admin_requests_total",
        "counter",
        "admin API requests by outcome",
        [
            (f'{{outcome="{k}"}}', admin[k])
            for k in ("requests", "unauthorized", "refused_busy", "rate_limited", "timeouts")
            if k in admin
        ],
    )
    return "\n".join(out) + "\n"
