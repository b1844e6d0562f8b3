"""The ``peer`` backend's config section, and host:port parsing.

Validated with :func:`lmcache_core.config.validate_section`, so every error names
the key path (``backends[1].peers[0]``) and where the value came from. Durations are
seconds (the old ``*_ms`` spellings are accepted with a deprecation warning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Field, SecretStr, model_validator

from lmcache_core.config import HOUR, ByteSize, ConfigError, Flag, StrictModel, seconds

Address = tuple[str, int]

MIN_SECRET_BYTES = 16
GENERATE_SECRET = "head -c 32 /dev/urandom | base64 > peer.secret && chmod 600 peer.secret"


def check_secret(secret: bytes) -> None:
    """Raise ValueError unless ``secret`` is long enough to resist guessing: at least
    :data:`MIN_SECRET_BYTES` bytes. The message says how to make a good one."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the shared secret is {len(secret)} bytes; it must be at least {MIN_SECRET_BYTES} "
            f"(random bytes, e.g. `{GENERATE_SECRET}`, then use secret_file)"
        )


def parse_address(value: Any, *, allow_port_zero: bool = False) -> Address:
    """``"host:port"`` or ``"[v6addr]:port"`` -> ``(host, port)``."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value = f"{value[0]}:{value[1]}"
    if not isinstance(value, str):
        raise ValueError(f"expected host:port (e.g. 10.0.0.5:9000), got {value!r}")
    text = value.strip()
    if text.startswith("["):
        host, sep, port_s = text[1:].partition("]:")
        if not sep or not host:
            raise ValueError(f"expected [ipv6]:port, got {value!r}")
    else:
        host, sep, port_s = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected host:port (e.g. 10.0.0.5:9000), got {value!r}")
        if ":" in host:
            raise ValueError(f"write IPv6 addresses in brackets, like [::1]:9000; got {value!r}")
    if any(c.isspace() for c in host):
        raise ValueError(f"host must not contain spaces, got {value!r}")
    if not port_s.isdigit():
        raise ValueError(f"port must be a number, got {port_s!r} in {value!r}")
    port = int(port_s)
    lo = 0 if allow_port_zero else 1
    if not lo <= port <= 65535:
        raise ValueError(f"port must be in {lo}..65535, got {port} in {value!r}")
    return host, port


ListenAddress = Annotated[Address, BeforeValidator(lambda v: parse_address(v, allow_port_zero=True))]
PeerAddress = Annotated[Address, BeforeValidator(parse_address)]


class PeerConfig(StrictModel):
    """``{name: peer, ...}``; see docs/backends/peer.md for every key."""

    listen: ListenAddress | None = Field(None, description="host:port to serve this instance's chunks on; null = don't serve")
    peers: list[PeerAddress] = Field(default_factory=list, description="host:port of the peers (or cache nodes) to ask")
    unix_socket: Path | None = Field(
        None,
        description="Unix socket of a cache node on this host (its --unix-socket): asked before peers, through shared memory",
    )
    shm: Flag = Field(
        True,
        description="with unix_socket, load straight from the node's shared memory; false: the socket carries the frames",
    )
    secret: SecretStr | None = Field(None, description="shared secret (prefer secret_file)")
    secret_file: Path | None = Field(None, description="file holding the shared secret")
    tenant: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="authenticate as this tenant of a shared node; the secret is then the tenant's own",
    )
    max_size: ByteSize = Field(1 << 30, description="bytes of chunks kept (and served) by this tier; 0 keeps none")
    push: Flag = Field(False, description="also send every put (and remove) to the peers, e.g. a shared cache node")
    timeout_s: Annotated[float, seconds(HOUR)] = Field(
        2.0, description="whole-request deadline in seconds (connect, auth, send, reply)"
    )
    connect_timeout_s: Annotated[float, seconds(600)] = Field(
        0.5, description="TCP connect deadline in seconds (within timeout_s)"
    )
    max_frame_size: ByteSize = Field(256 << 20, description="largest message accepted or sent (bounds one reply)")
    pool_size: int = Field(4, ge=1, le=256, description="idle connections kept per peer")
    retry_after_s: Annotated[float, seconds(HOUR, off=True)] = Field(
        1.0, description="a peer that failed is skipped for this many seconds"
    )
    max_connections: int = Field(64, ge=1, description="authenticated connections the server keeps at once")
    max_unauthenticated: int = Field(32, ge=1, description="connections still authenticating, kept apart from max_connections")
    max_unauthenticated_per_address: int = Field(4, ge=1, description="of those, from one client address")
    handshake_timeout_s: Annotated[float, seconds(600)] = Field(
        1.0, description="a new connection must authenticate within this many seconds"
    )
    eviction_poll_s: Annotated[float, seconds(HOUR, min_s=0.05, off=True)] = Field(
        2.0,
        description="with push, ask the nodes every this many seconds what they dropped (KV events for routers); 0: never",
    )
    max_inflight: ByteSize | None = Field(
        None, description="request bytes the server holds at once across connections; null: 2 x max_frame_size"
    )
    admin_urls: list[str] = Field(
        default_factory=list,
        description="admin APIs (http[s]://HOST:PORT) of the cache nodes among peers: lmcache-core erase reaches them there",
    )
    admin_token_file: Path | None = Field(None, description="the nodes' admin token (mode 600), for admin_urls")
    admin_ca_file: Path | None = Field(None, description="certificate authority of https admin_urls (default: the system's)")
    renamed_ms_keys = {
        "timeout_ms": "timeout_s",
        "connect_timeout_ms": "connect_timeout_s",
        "retry_after_ms": "retry_after_s",
        "handshake_timeout_ms": "handshake_timeout_s",
        "eviction_poll_ms": "eviction_poll_s",
    }

    @model_validator(mode="after")
    def _one_secret(self) -> "PeerConfig":
        if (self.secret is None) == (self.secret_file is None):
            raise ValueError("give exactly one of secret or secret_file")
        if self.secret is not None:
            check_secret(self.secret.get_secret_value().encode())
        if self.listen is None and not self.peers and self.unix_socket is None:
            raise ValueError("give listen (serve), peers or unix_socket (ask), or both; with neither the tier does nothing")
        if self.max_frame_size < 1024:
            raise ValueError("max_frame_size must be at least 1KiB")
        if self.admin_urls and self.admin_token_file is None:
            raise ValueError("admin_urls needs admin_token_file (the token the nodes' --admin-token-file holds)")
        for url in self.admin_urls:
            check_admin_url(url)
        return self


def check_admin_url(url: str) -> None:
    """ValueError unless ``url`` is ``http[s]://HOST:PORT`` (what a node prints)."""
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or port is None or u.path not in ("", "/") or u.query:
        raise ValueError(f"admin_urls: expected http[s]://HOST:PORT, got {url!r}")


def load_secret(cfg: PeerConfig, key_path: str, source: str) -> bytes:
    """The secret as bytes, from ``secret`` or ``secret_file`` (trailing newline
    stripped). Unreadable or empty files are config errors naming the key."""
    if cfg.secret is not None:
        return cfg.secret.get_secret_value().encode()
    assert cfg.secret_file is not None
    where = f"{key_path}.secret_file" if key_path else "secret_file"
    try:
        data = cfg.secret_file.read_bytes()
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {cfg.secret_file}: {err.strerror or err} (from {source})") from None
    data = data.rstrip(b"\r\n")
    if not data:
        raise ConfigError(f"{where}: {cfg.secret_file} is empty; put the shared secret in it (from {source})")
    try:
        check_secret(data)
    except ValueError as err:
        raise ConfigError(f"{where}: {cfg.secret_file}: {err} (from {source})") from None
    return data
