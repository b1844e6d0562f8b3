"""Building the redis-py client, and sorting redis-py errors into what they mean for a cache.

One client per tier; redis-py clients are thread-safe and pool their connections. The
pool blocks (up to the socket timeout) rather than failing when every connection is in
use, timeouts are set on connect and on every reply, and retries are few and bounded, so
every call returns in bounded time. A cluster client follows ``MOVED`` / ``ASK``
redirects itself and refreshes its slot map after a failover.
"""

from __future__ import annotations

import ssl
from enum import Enum
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .config import RedisConfig, redact

Client = Any  # redis.Redis | redis.cluster.RedisCluster (both expose pipeline/get/set)


def _retry(cfg: RedisConfig) -> Retry:
    return Retry(ExponentialBackoff(cap=0.2, base=0.01), cfg.retries)


def _tls_kwargs(cfg: RedisConfig) -> dict[str, Any]:
    if not cfg.uses_tls:
        return {}
    kw: dict[str, Any] = {
        "ssl_cert_reqs": ssl.CERT_REQUIRED if cfg.tls_verify else ssl.CERT_NONE,
        "ssl_check_hostname": cfg.tls_verify and cfg.tls_check_hostname,
    }
    if cfg.tls_ca_file is not None:
        kw["ssl_ca_certs"] = str(cfg.tls_ca_file)
    if cfg.tls_cert_file is not None:
        kw["ssl_certfile"] = str(cfg.tls_cert_file)
    if cfg.tls_key_file is not None:
        kw["ssl_keyfile"] = str(cfg.tls_key_file)
    return kw


def connection_kwargs(cfg: RedisConfig, password: str | None) -> dict[str, Any]:
    """Keyword arguments every connection (to any node) is made with."""
    kw: dict[str, Any] = {
        "socket_connect_timeout": cfg.connect_timeout_s,
        "socket_timeout": cfg.socket_timeout_s,
        "socket_keepalive": True,
        "retry": _retry(cfg),
        "client_name": "lmcache-core",
    }
    if cfg.username is not None:
        kw["username"] = cfg.username
    if password is not None:
        kw["password"] = password
    return kw


def _blocking_pool(wait_s: float) -> type[redis.BlockingConnectionPool]:
    """A pool class for the cluster's per-node pools that waits at most ``wait_s`` for a
    free connection (the cluster client passes its own keyword arguments to the pool)."""

    class Pool(redis.BlockingConnectionPool):
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("timeout", wait_s)
            super().__init__(**kwargs)

    return Pool


def make_client(cfg: RedisConfig, password: str | None) -> Client:
    """A redis-py client for ``cfg``: ``redis.Redis`` over a blocking pool, or ``RedisCluster``."""
    kw = connection_kwargs(cfg, password)
    if cfg.url is not None:
        pool = redis.BlockingConnectionPool.from_url(
            cfg.url, max_connections=cfg.max_connections, timeout=cfg.socket_timeout_s, **kw, **_tls_kwargs(cfg)
        )
        return redis.Redis(connection_pool=pool)
    assert cfg.cluster is not None
    if cfg.uses_tls:
        kw.update(ssl=True, **_tls_kwargs(cfg))
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in cfg.cluster],
        require_full_coverage=False,
        max_connections=cfg.max_connections,
        connection_pool_class=_blocking_pool(cfg.socket_timeout_s),
        **kw,
    )


class Failure(Enum):
    """What a failed call means for the tier."""

    UNAVAILABLE = "unavailable"  # down, timed out, loading, cluster down / slots moving, read-only replica
    DENIED = "denied"  # wrong password, unknown ACL user, missing ACL permission
    FULL = "full"  # OOM: maxmemory reached under noeviction (or nothing evictable)
    OTHER = "other"  # anything else: a miss, counted as an error


def classify(err: BaseException) -> Failure:
    if isinstance(err, RedisClusterException) and err.__cause__ is not None:
        return classify(err.__cause__)  # "cannot be connected": the reason is the cause
    if isinstance(err, (AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)):
        return Failure.DENIED
    if isinstance(err, ResponseError) and str(err).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
        return Failure.DENIED
    if isinstance(err, OutOfMemoryError) or (isinstance(err, ResponseError) and str(err).startswith("OOM")):
        return Failure.FULL
    if isinstance(
        err,
        (
            RedisConnectionError,
            RedisTimeoutError,
            BusyLoadingError,
            ClusterDownError,
            TryAgainError,
            ReadOnlyError,
            ClusterError,
            RedisClusterException,
            ConnectionError,
            TimeoutError,
            OSError,
        ),
    ):
        return Failure.UNAVAILABLE
    return Failure.OTHER


def describe(err: BaseException) -> str:
    """One line naming the error, with any URL credentials masked."""
    return redact(f"{type(err).__name__}: {err}")
