"""A tenant's quota and usage as the Mooncake master itself keeps them (``tenant_quota``).

``mooncake_master --enable_multi_tenants`` (with a tenant quota policy) gives every
client tenant (the ``tenant_id`` the client was set up with) its own object namespace
and a byte quota that the master enforces when it admits a put: a tenant at its quota
has its own objects evicted to make room (not those under a lease), or the put is
refused (``TENANT_QUOTA_EXCEEDED``); no other tenant's object is touched. The tier only
sets the client's ``tenant_id`` to the engine's tenant label; this module reads the
master's view of that tenant from its metrics server (Prometheus text), to check the
policy at startup and to report the usage in ``stats()``.
"""

from __future__ import annotations

import http.client
import re
import urllib.request
from dataclasses import dataclass

#: ``mooncake_tenant_<name>{tenant_id="<t>"[, ...]} <value>``
_LINE = re.compile(r'^mooncake_tenant_(\w+)\{tenant_id="((?:[^"\\]|\\.)*)"([^}]*)\}\s+(\S+)\s*$', re.M)


class QuotaUnknown(Exception):
    """The master's metrics could not be read (``unreachable``), or say no quota applies to the tenant."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's line of the master's quota accounting, in bytes."""

    tenant: str
    requested: int  # the policy's quota for the tenant
    effective: int  # what the master enforces: the requested quota, scaled down when the policy oversubscribes the pool
    charged: int  # the tenant's objects (and admitted puts in flight) now
    evicted: int  # bytes of the tenant's objects the master evicted for its quota, since the master started
    refused: int  # puts the master refused for the tenant's quota


def read_metrics(url: str, timeout_s: float) -> str:
    """The master's Prometheus text; raises QuotaUnknown saying why not."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(url, timeout=timeout_s) as reply:
            return str(reply.read(16 << 20).decode("utf-8", errors="replace"))
    except (OSError, ValueError, http.client.HTTPException) as err:  # URLError, HTTPError, timeouts: OSErrors
        reason = getattr(err, "reason", None) or err
        raise QuotaUnknown(f"cannot read the master's metrics at {url} ({reason})", unreachable=True) from None


def parse_quota(text: str, tenant: str) -> TenantQuota:
    """``tenant``'s quota and usage from the master's metrics ``text``; QuotaUnknown
    when the master keeps no tenant quotas, or none for ``tenant``."""
    values: dict[str, dict[str, float]] = {}
    for name, who, labels, value in _LINE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if name == "quota_reject_total" and 'reason="quota_exceeded"' not in labels:
            continue
        values.setdefault(who.replace('\\"', '"').replace("\\\\", "\\"), {})[name] = number
    listed = sorted(t for t, v in values.items() if "quota_effective_bytes" in v)
    if not listed:
        raise QuotaUnknown(
            "the master keeps no tenant quotas (its metrics have no mooncake_tenant_quota_* lines): start "
            "mooncake_master with --enable_multi_tenants=true --tenant_quota_connector_type=file "
            "--tenant_quota_connector_uri=<policy file> (docs/backends/mooncake.md)"
        )
    if tenant not in listed:
        raise QuotaUnknown(
            f"the master's tenant quota policy has no quota for tenant {tenant!r} (it lists {', '.join(map(repr, listed))}): "
            f'add "- name: {tenant}" with its quota to the policy file, or correct this engine\'s tenant label; '
            "until then the master refuses every put of this engine (TENANT_NOT_REGISTERED)"
        )
    v = values[tenant]
    return TenantQuota(
        tenant=tenant,
        requested=int(v.get("quota_requested_bytes", 0)),
        effective=int(v["quota_effective_bytes"]),
        charged=int(v.get("quota_charged_bytes", 0)),
        evicted=int(v.get("evict_bytes_total", 0)),
        refused=int(v.get("quota_reject_total", 0)),
    )


def tenant_quota(url: str, tenant: str, timeout_s: float) -> TenantQuota:
    """``tenant``'s quota and usage, read from the master's metrics at ``url``."""
    return parse_quota(read_metrics(url, timeout_s), tenant)
