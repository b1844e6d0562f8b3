"""Tenant isolation on a shared node: per-tenant secrets bound to a server-side namespace.

Chunk frames carry a checksum, not a MAC, so whoever may write a key on a node can
make any reader of that key load their bytes as a valid hit. On a node shared by
several tenants the node itself must therefore keep them apart. A tenant client
authenticates with its own secret (AUTH_TENANT, see :mod:`.auth`), and every key on
that connection is mapped into the tenant's own namespace (:class:`TenantSource`)
before it reaches the store: what tenant A writes under key K lands at
``(A, K)``, and tenant T asking for K reads ``(T, K)``. No key a client can send
reaches another tenant's entries, whatever secret it holds.

The mapping is a keyed hash under a key only the node knows: random, drawn once per
node process (the node keeps chunks in memory only, so nothing outlives it). With a
public key anyone could compute where T's key K is stored and send *that* key from
another principal; in particular the shared secret's principal, which would reach
the store by raw keys. So on a node with tenants the shared secret's principal gets
a mapped namespace of its own too (``tenant=None``), and no principal reads the
store by raw keys: each stored key is one that only the node can derive.

The tenants file (``lmcache-core serve --tenants-file``) has one ``NAME SECRET`` pair
per line, optionally followed by ``quota=SIZE`` (the bytes the node holds for that
tenant at most, see :class:`~lmcache_backend_peer.store.FrameStore`); blank lines and
``#`` comments are ignored.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

from lmcache_core.keys import HASH_BYTES, ChunkKey

from .config import check_secret
from .protocol import TENANT_NAME_RE

_NS_KEY = os.urandom(32)
"""This process's namespace key: never sent, logged or stored (see the module doc)."""
# The keyed hash's state after its key block: a copy hashes without compressing the
# key block again for every key (a LOOKUP may carry 16384).
_KEYED = hashlib.blake2b(digest_size=HASH_BYTES, key=_NS_KEY)


def tenant_key(tenant: str | None, key: ChunkKey) -> ChunkKey:
    """Where ``key`` of ``tenant`` (None: the shared secret's principal) lives in the
    node's store: a new namespace derived from the whole key under :data:`_NS_KEY`.
    The principal's label comes first and cannot end inside another's (tenant names
    hold no NUL), so two principals' namespaces meet only on a hash collision."""
    label = b"\0shared" if tenant is None else b"\1tenant:" + tenant.encode()
    h = _KEYED.copy()
    h.update(label + b"\0" + key.namespace + key.chunk_hash)
    return ChunkKey(h.digest(), key.chunk_hash)


class TenantSource:
    """A view of a shared source in which only ``tenant``'s entries exist (None: the
    shared secret's principal on a node with tenants). Frames keep the client's own
    key inside (the reader checks it); only the index is mapped."""

    def __init__(self, source: Any, tenant: str | None) -> None:
        self.source = source
        self.tenant = tenant

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        return int(self.source.contains([tenant_key(self.tenant, k) for k in keys]))

    def get_frame(self, key: ChunkKey) -> Any:
        return self.source.get_frame(tenant_key(self.tenant, key))

    def put_frame(self, key: ChunkKey, frame: bytes) -> bool:
        return bool(self.source.put_frame(tenant_key(self.tenant, key), frame, owner=self.tenant))

    def remove(self, key: ChunkKey) -> bool:
        return bool(self.source.remove(tenant_key(self.tenant, key)))


def parse_tenants(text: str, where: str) -> dict[str, bytes]:
    """``NAME SECRET [quota=SIZE]`` lines -> {name: secret}; ValueError naming the line
    on anything wrong (quotas: :func:`parse_quotas`)."""
    return _split(_entries(text, where))[0]


def parse_quotas(text: str, where: str) -> dict[str, int]:
    """The tenants given a ``quota=SIZE`` (bytes the node holds for them at most)."""
    return _split(_entries(text, where))[1]


def _split(entries: list[tuple[str, bytes, int | None]]) -> tuple[dict[str, bytes], dict[str, int]]:
    """{name: secret} and {name: quota} for those given one."""
    return {name: secret for name, secret, _ in entries}, {name: q for name, _, q in entries if q is not None}


def _entries(text: str, where: str) -> list[tuple[str, bytes, int | None]]:
    from lmcache_core.config import parse_size

    entries: list[tuple[str, bytes, int | None]] = []
    names: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ValueError(f"{where}:{n}: expected 'NAME SECRET [quota=SIZE]', got {len(parts)} fields")
        name, secret = parts[:2]
        if not TENANT_NAME_RE.match(name):
            raise ValueError(f"{where}:{n}: tenant name {name!r} must be 1-64 of A-Z a-z 0-9 . _ -")
        if name in names:
            raise ValueError(f"{where}:{n}: tenant {name!r} is listed twice")
        names.add(name)
        try:
            check_secret(secret.encode())
        except ValueError as err:
            raise ValueError(f"{where}:{n}: tenant {name!r}: {err}") from None
        quota = None
        if len(parts) == 3:
            field, _, size = parts[2].partition("=")
            if field != "quota":
                raise ValueError(f"{where}:{n}: tenant {name!r}: expected quota=SIZE, got {parts[2]!r}")
            try:
                quota = parse_size(size)
            except ValueError as err:
                raise ValueError(f"{where}:{n}: tenant {name!r}: quota: {err}") from None
            if quota <= 0:
                raise ValueError(f"{where}:{n}: tenant {name!r}: quota must be positive, got {size!r}")
        entries.append((name, secret.encode(), quota))
    if not entries:
        raise ValueError(f"{where}: no tenants in the file (one 'NAME SECRET' per line)")
    return entries


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None


def load_tenants(path: Path) -> dict[str, bytes]:
    return parse_tenants(_read(path), str(path))


def load_tenants_file(path: Path) -> tuple[dict[str, bytes], dict[str, int]]:
    """The tenants file read once: {name: secret} and {name: quota} for those given one."""
    return _split(_entries(_read(path), str(path)))
