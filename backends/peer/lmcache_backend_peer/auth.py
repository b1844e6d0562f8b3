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
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from .connection import Connection
from .protocol import (
    AUTH,
    AUTH_OK,
    CHALLENGE,
    ERROR,
    NONCE_SIZE,
    Auth,
    AuthOk,
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


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def client_handshake(conn: Connection, secret: bytes, deadline: float) -> bytes:
    """Authenticate both ways; returns the server's instance id."""
    header, body = conn.recv(deadline, HANDSHAKE_MAX_BODY)
    if header.type != CHALLENGE:
        raise ProtocolError(f"{conn.peer}: expected CHALLENGE, got message type {header.type}")
    ch = parse_body(header.type, body)
    if not isinstance(ch, Challenge):
        raise ProtocolError(f"{conn.peer}: malformed CHALLENGE")
    cnonce = os.urandom(NONCE_SIZE)
    conn.send(AUTH, 0, [cnonce, _mac(secret, _CLIENT_LABEL, ch.nonce, cnonce, ch.server_id)], deadline)
    header, body = conn.recv(deadline, HANDSHAKE_MAX_BODY)
    reply = parse_body(header.type, body)
    if isinstance(reply, ErrorReply):
        raise AuthError(f"{conn.peer}: server refused us: {reply.message}")
    if not isinstance(reply, AuthOk):
        raise ProtocolError(f"{conn.peer}: expected AUTH_OK, got message type {header.type}")
    if not hmac.compare_digest(reply.mac, _mac(secret, _SERVER_LABEL, cnonce, ch.nonce, ch.server_id)):
        raise AuthError(f"{conn.peer}: server failed to prove it knows the secret")
    return ch.server_id


def server_handshake(conn: Connection, secret: bytes, server_id: bytes, timeout: float) -> bool:
    """Challenge a fresh connection; True when the client proved the secret. On
    failure an ERROR is sent (best effort) and the caller closes the connection."""
    deadline = time.monotonic() + timeout
    snonce = os.urandom(NONCE_SIZE)
    conn.send(CHALLENGE, 0, [snonce, server_id], deadline)
    header, body = conn.recv(deadline, HANDSHAKE_MAX_BODY)
    if header.type != AUTH:
        raise ProtocolError(f"{conn.peer}: expected AUTH, got message type {header.type}")
    auth = parse_body(header.type, body)
    if not isinstance(auth, Auth):
        raise ProtocolError(f"{conn.peer}: malformed AUTH")
    if not hmac.compare_digest(auth.mac, _mac(secret, _CLIENT_LABEL, snonce, auth.nonce, server_id)):
        try:
            conn.send(ERROR, 0, [b"authentication failed"], deadline)
        except PeerError:
            pass
        return False
    conn.send(AUTH_OK, 0, [_mac(secret, _SERVER_LABEL, auth.nonce, snonce, server_id)], deadline)
    return True
