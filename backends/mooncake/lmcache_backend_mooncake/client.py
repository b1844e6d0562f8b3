"""The Mooncake client, set up and registered, behind a few typed calls.

Owns one ``MooncakeDistributedStore``: connects it to the master (``setup``),
registers memory regions with it (so transfers read and write them directly), and
exposes the batch calls the tier uses. Calls here are raw: deadlines and the health
gate are the caller's job (:mod:`.guard`). A client whose ``setup`` overran is
abandoned, never reused: the native object may still be inside ``setup``.
"""

from __future__ import annotations

import socket
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


def metadata_endpoint(metadata: str) -> tuple[str, int] | None:
    """``(host, port)`` of an http(s) metadata server, None for other kinds."""
    u = urlsplit(metadata)
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


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
    def __init__(self, cfg: MooncakeConfig) -> None:
        store_cls, replicate_cls = import_store()
        self.cfg = cfg
        self.hostname = cfg.local_hostname or route_address(cfg.master)
        self._store = store_cls()
        self._replicate = replicate_cls()
        self._replicate.replica_num = cfg.replicas
        self.connected = False

    def setup(self, probe_timeout_s: float = 2.0) -> None:
        """Connect to the master and mount ``segment_size`` bytes (if any); raises SetupFailed.

        The native ``setup`` retries an absent master for about 90 s while holding the
        GIL (no Python thread runs meanwhile, so no deadline can fire): the master and
        an http metadata server are first checked to accept TCP connections."""
        c = self.cfg
        endpoints = [split_host_port(c.master)]
        meta = metadata_endpoint(c.metadata)
        if meta is not None:
            endpoints.append(meta)
        for host, port in endpoints:
            why = reachable(host, port, probe_timeout_s)
            if why is not None:
                raise SetupFailed(why)
        rc = self._store.setup(self.hostname, c.metadata, c.segment_size, c.buffer_size, c.protocol, c.rdma_devices, c.master)
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

    def health(self) -> int:
        return int(self._store.health_check())

    def close(self) -> None:
        if self.connected:
            self.connected = False
            self._store.close()
