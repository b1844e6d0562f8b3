"""The Mooncake client, set up and registered, behind a few typed calls.

Owns one ``MooncakeDistributedStore``: connects it to the master (``setup``),
registers memory regions with it (so transfers read and write them directly), and
exposes the batch calls the tier uses. Calls here are raw: deadlines and the health
gate are the caller's job (:mod:`.guard`). A client whose ``setup`` overran is
abandoned, never reused: the native object may still be inside ``setup``.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.error
import urllib.request
from typing import Any, Sequence
from urllib.parse import urlsplit

from .config import MooncakeConfig, split_host_port


class SetupFailed(Exception):
    """``setup`` returned an error code: the master or metadata server refused or was away."""


def route_address(master: str) -> str:
    """The local address that routes to ``master``: what other nodes reach us at.
    No packet is sent (a UDP socket only picks a route)."""
    host, port = split_host_port(master)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def reachable(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as err:
        return f"{host}:{port} does not accept connections ({err.strerror or err})"


def answers_http(url: str, timeout_s: float) -> str | None:
    """None when an HTTP server at ``url`` answers a GET (any status) within
    ``timeout_s``, else why not. An open port is not enough: a stopped or wedged
    process still has the kernel accept its connections."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as a TCP connect, no proxy
    try:
        direct.open(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # 404 for an unknown key: the server answered
    except (http.client.HTTPException, ssl.SSLError):
        return None  # it answered, if not as urllib wanted (a bad status line, a certificate we do not trust)
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        if isinstance(reason, ssl.SSLError):
            return None
        return f"{url.split('?')[0]} did not answer a GET within {timeout_s:g} s ({reason})"
    return None


def import_store() -> Any:
    """The client class; a missing wheel or system library is an error that says what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as err:
        raise ImportError(
            f"the mooncake tier needs the Mooncake client: {err}. Install `mooncake-transfer-engine-non-cuda` "
            "(CPU hosts) or `mooncake-transfer-engine` (CUDA 12 hosts), and the system libraries "
            "libibverbs1 and librdmacm1 (apt-get install libibverbs1 librdmacm1)"
        ) from None
    return MooncakeDistributedStore, ReplicateConfig


class StoreClient:
    def __init__(self, cfg: MooncakeConfig, tenant: str | None = None) -> None:
        """``tenant``: the client's Mooncake tenant (``tenant_id``): its objects live in
        that tenant's namespace, under the master's quota for it. None: the client's
        default tenant, as before tenants existed."""
        store_cls, replicate_cls = import_store()
        self.cfg = cfg
        self.tenant = tenant
        self.hostname = cfg.local_hostname or route_address(cfg.master)
        self._store = store_cls()
        self._replicate = replicate_cls()
        self._replicate.replica_num = cfg.replicas
        self.connected = False

    def setup(self, probe_timeout_s: float = 2.0) -> None:
        """Connect to the master and mount ``segment_size`` bytes (if any); raises SetupFailed.

        The native ``setup`` holds the GIL while it waits (no Python thread runs
        meanwhile, so no deadline can fire): it retries an absent master for about 90 s,
        and a master that accepts connections but does not answer (stopped, or still
        starting on a loaded host) for 30 s per try, up to 20 tries. So the master is
        first checked to accept TCP connections, and an http metadata server (the
        master's own, in the documented setup) to answer a GET."""
        c = self.cfg
        why = reachable(*split_host_port(c.master), probe_timeout_s)
        if why is None and urlsplit(c.metadata).scheme in ("http", "https"):
            why = answers_http(f"{c.metadata}?key=lmcache-probe", probe_timeout_s)
        if why is not None:
            raise SetupFailed(why)
        args = (self.hostname, c.metadata, c.segment_size, c.buffer_size, c.protocol, c.rdma_devices, c.master)
        if self.tenant is None:
            rc = self._store.setup(*args)
        else:
            try:
                rc = self._store.setup(*args, tenant_id=self.tenant)
            except TypeError as err:  # a client from before tenants: its setup has no tenant_id
                raise SetupFailed(
                    f"this Mooncake client cannot set a tenant ({err}); tenant_quota needs one whose setup takes "
                    "tenant_id (mooncake-transfer-engine 0.3.13.post1 does)"
                ) from None
        if rc != 0:
            raise SetupFailed(f"setup returned {rc}")
        self.connected = True

    def register(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise SetupFailed(f"register_buffer({size} bytes) returned {rc}")

    def exist(self, keys: Sequence[str]) -> list[int]:
        return list(self._store.batch_is_exist(list(keys)))

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return list(self._store.batch_get_into(list(keys), list(ptrs), list(sizes)))

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Each object written from several buffers (frame header, payload) in one call."""
        return list(
            self._store.batch_put_from_multi_buffers(
                list(keys), [list(p) for p in ptrs], [list(s) for s in sizes], self._replicate
            )
        )

    def remove(self, keys: Sequence[str]) -> list[int]:
        # force: an object read a moment ago still holds a lease; the cache wants it gone now.
        return list(self._store.batch_remove(list(keys), True))

    def remove_matching(self, pattern: str) -> list[int]:
        """Remove every object whose key matches ``pattern`` (the master's ECMAScript
        regex), forced as :meth:`remove`: ``[count]``, or ``[negative code]``."""
        return [int(self._store.remove_by_regex(pattern, True))]

    def health(self) -> int:
        return int(self._store.health_check())

    def close(self) -> None:
        if self.connected:
            self.connected = False
            self._store.close()
