"""The ``redis`` section of ``backends:``: every option, its default and its bounds.

Validated with :func:`lmcache_core.config.validate_section`, so a wrong value fails at
startup with its key path and source instead of degrading silently. A password may sit
in the URL, in ``password`` or (preferred) in ``password_file``; it never appears in
``repr``, logs or error messages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator

from lmcache_core.config import DAY, HOUR, ByteSize, ConfigError, Flag, StrictModel, seconds

#: Redis' default ``proto-max-bulk-len``: the largest string a server accepts.
SERVER_MAX_BULK = 512 * 2**20
_SCHEMES = ("redis", "rediss", "unix")


def parse_node(value: Any) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> ``(host, port)``."""
    if not isinstance(value, str):
        raise ValueError(f"expected host:port (e.g. 10.0.0.5:6379), got {value!r}")
    text = value.strip()
    if text.startswith("["):
        host, sep, port_s = text[1:].partition("]:")
    else:
        host, sep, port_s = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"write IPv6 addresses in brackets, like [::1]:6379; got {value!r}")
    if not sep or not host or any(c.isspace() for c in host):
        raise ValueError(f"expected host:port (e.g. 10.0.0.5:6379), got {value!r}")
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"port must be a number in 1..65535, got {port_s!r} in {value!r}")
    return host, int(port_s)


Node = Annotated[tuple[str, int], BeforeValidator(parse_node)]


class RedisConfig(StrictModel):
    """``{name: redis, ...}``; see docs/backends/redis.md for every key."""

    url: str | None = Field(None, description="redis://[user:pass@]host:port/db, rediss:// for TLS, or unix:///path")
    cluster: list[Node] | None = Field(None, description="host:port of one or more Redis Cluster nodes (seeds)")
    username: str | None = Field(None, description="ACL user (Redis 6+); overrides one in the URL")
    password: SecretStr | None = Field(None, description="password (prefer password_file); overrides one in the URL")
    password_file: Path | None = Field(None, description="file holding the password (trailing newline stripped)")
    tls: Flag = Field(False, description="TLS to the cluster nodes (for url, use the rediss:// scheme)")
    tls_ca_file: Path | None = Field(None, description="CA bundle that signed the server certificate")
    tls_cert_file: Path | None = Field(None, description="client certificate (servers with tls-auth-clients)")
    tls_key_file: Path | None = Field(None, description="client private key")
    tls_verify: Flag = Field(True, description="verify the server certificate (false: encrypted but unauthenticated)")
    tls_check_hostname: Flag = Field(True, description="the certificate must name the host connected to")
    prefix: str = Field("lmcache:", description="every key is {prefix}{chunk key}")
    ttl_s: Annotated[float, seconds(365 * DAY)] | None = Field(
        None, description="expire chunks this long after they are stored; null: never"
    )
    max_value_size: ByteSize = Field(
        64 * 2**20, description="frames larger than this are refused (the put is skipped), never split"
    )
    tenant_quota: ByteSize | None = Field(
        None,
        description="hard byte quota of this engine's tenant (the top-level tenant label) on the server or cluster: a "
        "put past it deletes the tenant's own oldest chunks first, one larger than it is refused; "
        "null: no quota",
    )
    connect_timeout_s: Annotated[float, seconds(60)] = Field(1.0, description="TCP (and TLS) connect deadline per attempt")
    socket_timeout_s: Annotated[float, seconds(600)] = Field(5.0, description="deadline for each socket read or write")
    call_timeout_s: Annotated[float, seconds(600)] = Field(
        5.0,
        description="deadline for one whole call (a pipeline): pool wait, connect, sending, every reply, "
        "reconnects and retries included",
    )
    retries: int = Field(1, ge=0, le=10, description="redis-py retries after a connection error or timeout")
    max_connections: int = Field(32, ge=1, le=1024, description="pooled connections per server node")
    write_concurrency: int = Field(4, ge=1, le=64, description="background puts the engine runs at once")
    check_exists_before_put: Flag = Field(
        True, description="EXISTS before SET so chunks another instance stored are not sent again"
    )
    down_cooldown_s: Annotated[float, seconds(HOUR, off=True)] = Field(
        5.0, description="after a server failure, calls are misses for this long"
    )
    verify_on_start: Flag = Field(True, description="PING the server(s) when the tier is created")
    delete_corrupt: Flag = Field(
        False,
        description="delete values found damaged when read (checksum or MAC mismatch, truncated, malformed); frames another reader may take are kept",
    )
    max_key_events_per_s: int = Field(
        1000,
        ge=1,
        le=10**7,
        description="key-event messages read (and names checked with EXISTS) in any one second at most; past it the "
        "subscription pauses for the rest of that second (what the server publishes meanwhile is dropped, counted)",
    )
    eviction_events: Flag = Field(
        True,
        description="with KV events on, report keys the server evicts or expires (keyspace notifications; "
        "turns notify-keyspace-events' E, x, e flags on when missing, see configure_keyspace_events)",
    )
    configure_keyspace_events: bool = Field(
        True,
        description="add the E, x, e flags to the server's notify-keyspace-events when missing (CONFIG SET, the "
        "server's own flags kept); false: never change it (events only where the operator set them)",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in _SCHEMES:
            raise ValueError(f"url must start with redis://, rediss:// (TLS) or unix://, got {parts.scheme or v!r}://")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("url has no host: write redis://host:6379/0")
        try:
            _ = parts.port  # urllib parses the port lazily: this raises for a bad one
        except ValueError:
            raise ValueError("url has an invalid port") from None
        db = parts.path.strip("/")
        if parts.scheme != "unix" and db and not db.isdigit():
            raise ValueError(f"the url's path is the database number (redis://host:6379/0), got /{db}")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if "{" in v or "}" in v:
            raise ValueError(
                f"prefix {v!r} must not contain '{{' or '}}': Redis Cluster would read it as a hash tag and "
                "put every chunk in one slot (one node)"
            )
        if any(c.isspace() for c in v):
            raise ValueError(f"prefix {v!r} must not contain whitespace")
        return v

    @model_validator(mode="after")
    def _check(self) -> "RedisConfig":
        if (self.url is None) == (self.cluster is None):
            raise ValueError("give exactly one of url (a single server) or cluster (a list of host:port seeds)")
        if self.cluster is not None and not self.cluster:
            raise ValueError("cluster needs at least one host:port")
        if self.password is not None and self.password_file is not None:
            raise ValueError("give at most one of password or password_file")
        if self.url is not None and self.tls:
            raise ValueError("tls is for cluster: for a single server write the url as rediss://host:port")
        if self.max_value_size < 4096 or self.max_value_size > SERVER_MAX_BULK:
            raise ValueError(
                f"max_value_size must be between 4KiB and 512MiB (Redis' proto-max-bulk-len), got {self.max_value_size}"
            )
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_key_file needs tls_cert_file")
        self._check_quota()
        return self

    def _check_quota(self) -> None:
        if self.tenant_quota is None:
            return
        if self.tenant_quota < 1:
            raise ValueError("tenant_quota must be a positive size (e.g. 8GiB); leave it out for no quota")

    @property
    def uses_tls(self) -> bool:
        return self.tls or (self.url is not None and self.url.startswith("rediss://"))

    def target(self) -> str:
        """Where the tier points, for messages: the URL without credentials, or the cluster seeds."""
        if self.url is not None:
            parts = urlsplit(self.url)
            netloc = parts.netloc.rpartition("@")[2]
            return parts._replace(netloc=netloc).geturl()
        nodes = ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.cluster or [])
        return f"cluster {nodes}"


def load_password(cfg: RedisConfig, key_path: str, source: str) -> str | None:
    """The password from ``password`` or ``password_file``; None leaves the URL's (if any).
    An unreadable or empty file is a config error naming the key."""
    if cfg.password is not None:
        return cfg.password.get_secret_value()
    if cfg.password_file is None:
        return None
    where = f"{key_path}.password_file" if key_path else "password_file"
    try:
        text = cfg.password_file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}: cannot read {cfg.password_file}: {err} (from {source})") from None
    text = text.rstrip("\r\n")
    if not text:
        raise ConfigError(f"{where}: {cfg.password_file} is empty; put the Redis password in it (from {source})")
    return text


def check_tls_files(cfg: RedisConfig, key_path: str, source: str) -> None:
    """TLS files must exist and be readable before any connection tries them."""
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        path = getattr(cfg, name)
        if path is None:
            continue
        if not cfg.uses_tls:
            raise ConfigError(
                f"{key_path}.{name}: TLS is not enabled (use a rediss:// url or tls: true for cluster) (from {source})"
            )
        if not Path(path).is_file():
            raise ConfigError(f"{key_path}.{name}: {path} is not a readable file (from {source})")


_REDACT = re.compile(r"(//[^:/@]*:)[^@]*@")


def redact(text: str) -> str:
    """``text`` with any ``user:password@`` in a URL reduced to ``user:***@``."""
    return _REDACT.sub(r"\1***@", text)
