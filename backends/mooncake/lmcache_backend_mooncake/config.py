"""The ``mooncake`` section of ``backends:``: every option, its default and its bounds.

Validated with :func:`lmcache_core.config.validate_section`, so a wrong value fails
at startup with its key path and source. Sizes take units (``4GiB``, ``512MiB``);
durations are seconds (the old ``*_ms`` spellings are accepted with a deprecation warning).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from lmcache_core.config import HOUR, ByteSize, Flag, StrictModel, seconds

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+):([0-9]{1,5})$")
_METADATA = re.compile(r"^(https?://[^/\s]+(/\S*)?|etcd://\S+|redis://\S+|P2PHANDSHAKE)$")
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9._/\-]{0,128}$")
_METRICS = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+):([0-9]{1,5})/?$")
#: the port of mooncake_master's HTTP metrics server when --metrics_port is not given
MASTER_METRICS_PORT = 9003


def split_host_port(value: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises ValueError naming the format."""
    m = _HOST_PORT.match(value.strip())
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"expected host:port (e.g. 10.0.0.5:50051), got {value!r}")
    return m.group(1).strip("[]"), int(m.group(2))


class MooncakeConfig(StrictModel):
    """``{name: mooncake, ...}``; docs/backends/mooncake.md explains every key."""

    master: str = Field(description="host:port of mooncake_master's RPC service")
    metadata: str = Field(
        description="transfer metadata server: http://host:port/metadata (the master's own with "
        "--enable_http_metadata_server), etcd://..., redis://... or P2PHANDSHAKE"
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="transport between this client and segment owners")
    rdma_devices: str = Field("", description="RDMA NICs to use, comma-separated (protocol: rdma); '' = all")
    local_hostname: str | None = Field(
        None, description="address other nodes reach this client at; None = the local address that routes to the master"
    )
    segment_size: ByteSize = Field(
        0, description="DRAM this process contributes to the pool (0 = a pure client of store services)"
    )
    buffer_size: ByteSize = Field(64 << 20, description="the client's own transfer buffer (local_buffer_size)")
    replicas: int = Field(1, ge=1, le=16, description="memory replicas written per chunk")
    key_prefix: str = Field("lmcache/", description="object keys are {key_prefix}{chunk key}")
    timeout_s: Annotated[float, seconds(600)] = Field(2.0, description="deadline in seconds of one store call (lookup, get, put)")
    setup_timeout_s: Annotated[float, seconds(600)] = Field(15.0, description="deadline in seconds of connecting to the master")
    down_cooldown_s: Annotated[float, seconds(600, off=True)] = Field(
        2.0,
        description="after the master fails or a call overruns, calls are misses for this many seconds",
    )
    renamed_ms_keys = {"timeout_ms": "timeout_s", "setup_timeout_ms": "setup_timeout_s", "down_cooldown_ms": "down_cooldown_s"}
    max_inflight: int = Field(8, ge=1, le=256, description="store calls running at once (and background writers)")
    staging_size: ByteSize = Field(
        128 << 20, description="registered memory that gets land in (checked there, then copied into the pool)"
    )
    quarantine_s: Annotated[float, seconds(HOUR, off=True)] = Field(
        30.0, description="staging memory of a failed or overrun transfer is not reused for this long"
    )
    verify_on_start: Flag = Field(True, description="fail at startup when the master cannot be reached")
    tenant_quota: Flag = Field(
        False,
        description="the engine's tenant label is its Mooncake tenant: its objects live in that tenant's namespace "
        "and the master's tenant quota policy (mooncake_master --enable_multi_tenants) bounds their bytes",
    )
    master_metrics: str | None = Field(
        None,
        description="http://host:port of mooncake_master's metrics server (--metrics_port), read for the tenant's "
        "quota and usage (tenant_quota); None = the master's host, port 9003",
    )

    def metrics_url(self) -> str:
        """Where the master's Prometheus text is: ``master_metrics`` or the master's host, port 9003."""
        if self.master_metrics is not None:
            return self.master_metrics.rstrip("/") + "/metrics"
        host, _ = split_host_port(self.master)
        return f"http://{f'[{host}]' if ':' in host else host}:{MASTER_METRICS_PORT}/metrics"

    @field_validator("master")
    @classmethod
    def _master(cls, v: str) -> str:
        split_host_port(v)
        return v.strip()

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: str) -> str:
        if not _METADATA.match(v.strip()):
            raise ValueError(
                "expected http://host:port/metadata (the master's HTTP metadata server), etcd://host:port, "
                f"redis://host:port or P2PHANDSHAKE, got {v!r}"
            )
        return v.strip()

    @field_validator("tenant_quota", mode="before")
    @classmethod
    def _tenant_quota(cls, v: object) -> object:
        if v is not True and v is not False:
            raise ValueError(
                f"must be true or false, got {v!r}: the mooncake tier's quota per tenant is set on the master, in "
                "its tenant quota policy (mooncake_master --enable_multi_tenants --tenant_quota_connector_uri=FILE), "
                "not here; tenant_quota: true makes this engine write as its tenant label"
            )
        return v

    @field_validator("master_metrics")
    @classmethod
    def _master_metrics(cls, v: str | None) -> str | None:
        if v is None:
            return None
        m = _METRICS.match(v.strip())
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(
                f"expected http://host:port of mooncake_master's metrics server (its --metrics_port, 9003 by default), got {v!r}"
            )
        return v.strip().rstrip("/")

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not _KEY_PREFIX.match(v):
            raise ValueError(f"key_prefix may hold letters, digits and . _ / - (at most 128), got {v!r}")
        return v

    @model_validator(mode="after")
    def _sizes(self) -> "MooncakeConfig":
        if self.buffer_size < 1 << 20:
            raise ValueError(f"buffer_size must be at least 1MiB, got {self.buffer_size}")
        if self.staging_size < 1 << 20:
            raise ValueError(f"staging_size must be at least 1MiB (it must hold one chunk's frame), got {self.staging_size}")
        if self.segment_size and self.segment_size < 16 << 20:
            raise ValueError(f"segment_size must be 0 or at least 16MiB, got {self.segment_size}")
        if self.rdma_devices and self.protocol != "rdma":
            raise ValueError("rdma_devices is only used with protocol: rdma")
        if self.master_metrics is not None and not self.tenant_quota:
            raise ValueError("master_metrics is only used with tenant_quota: true")
        return self
