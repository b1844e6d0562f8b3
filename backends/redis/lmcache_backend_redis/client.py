"""Building the redis-py client, and sorting redis-py errors into what they mean for a cache.

One client per tier; redis-py clients are thread-safe and pool their connections. The
pool blocks rather than failing when every connection is in use, and retries are few.

**Deadlines.** redis-py's timeouts bound each socket read, not a reply: a server (or a
link) that sends a few bytes every fraction of a second keeps a 256 KiB reply going for
minutes, and every retry starts the clock again. So every call the tier makes runs
under :func:`call_deadline`: one absolute time, per thread, that every step of the call
shares: waiting for a pooled connection, connecting (TCP and TLS), each write and each
read of the reply, reconnects and redis-py's retries. Our connection classes wrap the
socket (:class:`_DeadlineSocket`) so each read and write gets the time that is left (at
most the socket timeout) and none starts once it is gone: the call then fails as a
redis-py ``TimeoutError``, like any other timeout, and the tier answers a miss.

A cluster client follows ``MOVED`` / ``ASK`` redirects itself and refreshes its slot
map after a failover.
"""

from __future__ import annotations

import functools
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from enum import Enum
from typing import Any, Iterator

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


_deadline = threading.local()


@contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """Every redis-py socket operation, connect, pool wait and retry this thread makes
    inside the block ends by ``seconds`` from now (a nested block can only shorten it)."""
    prev: float | None = getattr(_deadline, "at", None)
    at = time.monotonic() + seconds
    _deadline.at = at if prev is None else min(prev, at)
    try:
        yield
    finally:
        _deadline.at = prev


def time_left() -> float | None:
    """Seconds left of this thread's call deadline, or None outside :func:`call_deadline`."""
    at: float | None = getattr(_deadline, "at", None)
    return None if at is None else at - time.monotonic()


def _left_or_raise(what: str) -> float | None:
    left = time_left()
    if left is not None and left <= 0:
        raise socket.timeout(f"redis call deadline passed before {what}")
    return left


class _DeadlineSocket:
    """A connected socket (plain or TLS) whose reads and writes never outlive the
    calling thread's :func:`call_deadline`: each gets ``min(socket timeout, time
    left)``, and none starts after the deadline. Everything else is the socket's."""

    __slots__ = ("_sock", "_timeout")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout: float | None = sock.gettimeout()

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self, what: str) -> None:
        left = _left_or_raise(what)
        if left is None:
            self._sock.settimeout(self._timeout)
        elif self._timeout is None or left < self._timeout:
            self._sock.settimeout(left)
        else:
            self._sock.settimeout(self._timeout)

    def recv(self, *args: Any) -> Any:
        self._arm("a read")
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        self._arm("a read")
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> Any:
        self._arm("a write")
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> Any:
        self._arm("a write")
        return self._sock.sendall(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineConnection:
    """Mixed into redis-py's connection classes (:func:`deadline_connection_class`):
    connects within the time left, and hands redis-py a :class:`_DeadlineSocket`."""

    socket_connect_timeout: float | None
    deadline_socket: _DeadlineSocket | None = None

    def _connect(self) -> Any:
        left = _left_or_raise("connecting")
        saved = self.socket_connect_timeout
        if left is not None and (saved is None or left < saved):
            self.socket_connect_timeout = left
        try:
            sock = super()._connect()  # type: ignore[misc]
        finally:
            self.socket_connect_timeout = saved
        self.deadline_socket = _DeadlineSocket(sock)  # wire.read_ranges reads replies from it
        return self.deadline_socket


@functools.lru_cache(maxsize=None)
def deadline_connection_class(cls: type) -> type:
    """``cls`` (redis-py's TCP, TLS or Unix connection class) under call deadlines."""
    if issubclass(cls, _DeadlineConnection):
        return cls
    return type(f"Deadline{cls.__name__}", (_DeadlineConnection, cls), {})


class DeadlinePool(redis.BlockingConnectionPool):
    """A blocking pool whose connections run under call deadlines and whose wait for
    a free connection ends with the call's deadline too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.connection_class = deadline_connection_class(self.connection_class)

    @property
    def timeout(self) -> float | None:
        left = time_left()
        if left is None:
            return self._wait_s
        return max(0.0, left if self._wait_s is None else min(self._wait_s, left))

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._wait_s = value


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

    class Pool(DeadlinePool):
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("timeout", wait_s)
            super().__init__(**kwargs)

    return Pool


def make_client(cfg: RedisConfig, password: str | None) -> Client:
    """A redis-py client for ``cfg``: ``redis.Redis`` over a blocking pool, or ``RedisCluster``."""
    kw = connection_kwargs(cfg, password)
    if cfg.url is not None:
        pool = DeadlinePool.from_url(
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
