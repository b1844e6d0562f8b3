"""Build a :class:`PeerBackend` from its ``backends:`` section."""

from __future__ import annotations

from typing import Any, Mapping

from lmcache_core.backend import BackendContext
from lmcache_core.config import ConfigError, validate_section

from .backend import PeerBackend
from .client import PeerClient, format_address
from .config import PeerConfig, load_secret
from .server import PeerServer
from .store import FrameStore


def create_peer_backend(section: Mapping[str, Any], ctx: BackendContext) -> PeerBackend:
    """Validate the section, start the server when ``listen`` is set, and connect
    lazily to ``peers`` (a peer that is down at start-up is just a miss for now)."""
    cfg = validate_section(PeerConfig, section, ctx.key_path, ctx.source)
    secret = load_secret(cfg, ctx.key_path, ctx.source)
    store = FrameStore(cfg.max_size)
    timeout = cfg.timeout_s
    server = None
    if cfg.listen is not None and ctx.serving:  # a command (erase) serves nothing
        try:
            # With a tenant, the instances of that tenant serve each other; the store
            # holds only this instance's chunks, so no partitioning is needed.
            server = PeerServer(
                store,
                cfg.listen,
                None if cfg.tenant else secret,
                tenants={cfg.tenant: secret} if cfg.tenant else None,
                partition_tenants=False,
                writable=False,
                max_frame_size=cfg.max_frame_size,
                timeout=timeout,
                max_connections=cfg.max_connections,
                handshake_timeout=cfg.handshake_timeout_s,
                max_unauthenticated=cfg.max_unauthenticated,
                max_unauthenticated_per_address=cfg.max_unauthenticated_per_address,
                max_inflight_bytes=cfg.max_inflight,
            )
        except ValueError as err:
            raise ConfigError(f"{ctx.key_path}: {err} (from {ctx.source})") from None
        except OSError as err:
            raise ConfigError(
                f"{ctx.key_path}.listen: cannot listen on {format_address(cfg.listen)}: {err.strerror or err} (from {ctx.source})"
            ) from None
    peers: list[tuple[str, int] | str] = [a for a in dict.fromkeys(cfg.peers) if a != cfg.listen]
    if cfg.unix_socket is not None:
        peers.insert(0, str(cfg.unix_socket))
    clients = [
        PeerClient(
            a,
            secret,
            timeout=timeout,
            connect_timeout=min(cfg.connect_timeout_s, cfg.timeout_s),
            max_frame_size=cfg.max_frame_size,
            pool_size=cfg.pool_size,
            tenant=cfg.tenant,
        )
        for a in peers
    ]
    admins = None
    if cfg.admin_urls and cfg.admin_token_file:
        from .admin_cli import NodeAdmins  # only erase uses it: engines never load the admin code

        admins = NodeAdmins(cfg.admin_urls, cfg.admin_token_file, cfg.admin_ca_file)
    return PeerBackend(
        store,
        clients,
        codec=ctx.codec,
        codecs=ctx.codecs,
        server=server,
        push=cfg.push,
        retry_after=cfg.retry_after_s,
        shm=cfg.shm,
        eviction_poll=cfg.eviction_poll_s,
        admins=admins,
    )
