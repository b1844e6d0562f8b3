"""Mutual HMAC-SHA256 challenge-response at connection start.

1. server -> CHALLENGE: server nonce (32 random bytes) and the server's instance id
2. client -> AUTH: client nonce and HMAC(secret, "client" | server nonce | client nonce | id)
3. server -> AUTH_OK: HMAC(secret, "server" | client nonce | server nonce | id),
   or ERROR and the connection is closed.

The server reads no request before step 3, so a client without the secret can neither
read nor write chunks; the client checks step 3, so a server without the secret
cannot feed it data. Both nonces are fresh per connection, so a recorded handshake
cannot be replayed. Handshake messages have a tiny size limit: an unauthenticated
connection cannot make the server allocate more than a few bytes.

Tenants: a node may hold per-tenant secrets (:class:`Credentials`). A tenant client
sends AUTH_TENANT instead of AUTH, naming its tenant and proving *that tenant's*
secret (the name is inside both MACs, so it cannot be swapped). The server then binds
the connection to the tenant's namespace (see the server): holding the node's shared
secret, or another tenant's, gives no access to it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field
from typing import Mapping

from .connection import Connection
from .protocol import (
    AUTH,
    AUTH_OK,
    AUTH_TENANT,
    CHALLENGE,
    ERROR,
    NONCE_SIZE,
    Auth,
    AuthOk,
    AuthTenant,
    Challenge,
    ErrorReply,
    PeerError,
    ProtocolError,
    parse_body,
)

HANDSHAKE_MAX_BODY = 128
_CLIENT_LABEL = b"lmcache-peer/v1/client"
_SERVER_LABEL = b"lmcache-peer/v1/server"


class AuthError(PeerError):
    """The other side does not know the shared secret."""


@dataclass(frozen=True)
class Credentials:
    """What a server accepts: the shared secret (optional when tenants are given) and
    per-tenant secrets."""

    shared: bytes | None
    tenants: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Principal:
    """Who a connection authenticated as: a named tenant, or (None) the shared secret."""

    tenant: str | None


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _tenant_part(tenant: str | None) -> bytes:
    return b"" if tenant is None else b"tenant:" + tenant.encode()


def client_handshake(conn: Connection, secret: bytes, deadline: float, tenant: str | None = None) -> bytes:
    """Authenticate both ways (as ``tenant`` when given, with that tenant's secret);
    returns the server's instance id."""
    header, body = conn.recv(deadline, HANDSHAKE_MAX_BODY)
    if header.type != CHALLENGE:
        raise ProtocolError(f"{conn.peer}: expected CHALLENGE, got message type {header.type}")
    ch = parse_body(header.type, body)
    if not isinstance(ch, Challenge):
        raise ProtocolError(f"{conn.peer}: malformed CHALLENGE")
    cnonce = os.urandom(NONCE_SIZE)
    tpart = _tenant_part(tenant)
    proof = _mac(secret, _CLIENT_LABEL, ch.nonce, cnonce, ch.server_id, tpart)
    if tenant is None:
        conn.send(AUTH, 0, [cnonce, proof], deadline)
    else:
        conn.send(AUTH_TENANT, 0, [cnonce, proof, tenant.encode()], deadline)
    header, body = conn.recv(deadline, HANDSHAKE_MAX_BODY)
    reply = parse_body(header.type, body)
    if isinstance(reply, ErrorReply):
        raise AuthError(f"{conn.peer}: server refused us: {reply.message}")
    if not isinstance(reply, AuthOk):
        raise ProtocolError(f"{conn.peer}: expected AUTH_OK, got message type {header.type}")
    if not hmac.compare_digest(reply.mac, _mac(secret, _SERVER_LABEL, cnonce, ch.nonce, ch.server_id, tpart)):
        raise AuthError(f"{conn.peer}: server failed to prove it knows the secret")
    return ch.server_id


def server_handshake(conn: Connection, secret: bytes, server_id: bytes, timeout: float) -> bool:
    """Challenge a fresh connection; True when the client proved the shared secret."""
    return server_authenticate(conn, Credentials(secret), server_id, timeout) is not None


def server_authenticate(conn: Connection, creds: Credentials, server_id: bytes, timeout: float) -> Principal | None:
    """Challenge a fresh connection; who it proved to be, or None. On failure an ERROR
    is sent (best effort) and the caller closes the connection."""
    deadline = time.monotonic() + timeout
    snonce = os.urandom(NONCE_SIZE)
    conn.send(CHALLENGE, 0, [snonce, server_id], deadline)
    header, body = conn.recv(deadline, HANDSHAKE_MAX_BODY)
    if header.type not in (AUTH, AUTH_TENANT):
        raise ProtocolError(f"{conn.peer}: expected AUTH, got message type {header.type}")
    auth = parse_body(header.type, body)
    if isinstance(auth, AuthTenant):
        tenant: str | None = auth.tenant
        secret = creds.tenants.get(auth.tenant)
    elif isinstance(auth, Auth):
        tenant, secret = None, creds.shared
    else:
        raise ProtocolError(f"{conn.peer}: malformed AUTH")
    # An unknown tenant is checked against a throwaway key, so timing does not tell
    # which tenant names exist.
    key = secret if secret is not None else os.urandom(32)
    tpart = _tenant_part(tenant)
    if secret is None or not hmac.compare_digest(auth.mac, _mac(key, _CLIENT_LABEL, snonce, auth.nonce, server_id, tpart)):
        try:
            conn.send(ERROR, 0, [b"authentication failed"], deadline)
        except PeerError:
            pass
        return None
    conn.send(AUTH_OK, 0, [_mac(key, _SERVER_LABEL, auth.nonce, snonce, server_id, tpart)], deadline)
    return Principal(tenant)
