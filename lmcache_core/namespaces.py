"""Namespace records: what a key namespace id stands for, kept next to the chunks.

A chunk key carries only a hash of its namespace (model, KV layout, dtype, rank,
tenant salt: :class:`~lmcache_core.keys.KeyNamespace`), so nothing in a tier says
which model or tenant wrote it. Each engine therefore writes one small record per
tier it writes to, at start: its namespace id with the model, the tenant *label*
(``tenant``; never the salt) and the rest of the namespace. ``lmcache-core erase
--model M`` / ``--tenant T`` reads the records of every tier, takes the ids that
match and erases those ids everywhere.

A tier keeps records through two optional methods
(:meth:`~lmcache_core.backend.StorageBackend.record_namespace` and
:meth:`~lmcache_core.backend.StorageBackend.namespace_records`), outside its chunk
budget and its eviction. A record holds no KV and no secret; erase leaves it in
place, so chunks written after an erase are still found by the next one. Records
are read as untrusted bytes: bounded in size and count, and a record that does not
parse, or names another id than the one it is filed under, is skipped.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .keys import HASH_BYTES, KeyNamespace

log = logging.getLogger(__name__)

RECORD_VERSION = 1
#: a record's size at most, in bytes (a longer one is skipped when read)
MAX_RECORD_BYTES = 4096
#: records one tier is asked for at most (a listing stops there)
MAX_RECORDS = 100_000
#: what a tier that names things by string files a record under: this, then the id
#: (after the tier's own prefix; S3 and Redis)
RECORD_NAME = "lmcache-ns-"
#: what ``tenant`` may be: a label, not a secret
TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class NamespaceRecord:
    """One namespace id and what it stands for (the salt left out)."""

    namespace: bytes
    model: str
    tenant: str | None
    layout: str
    dtype: str
    world_size: int
    rank: int

    @classmethod
    def of(cls, ns: KeyNamespace, tenant: str | None) -> "NamespaceRecord":
        return cls(ns.id, ns.model, tenant, ns.layout, ns.dtype, ns.world_size, ns.rank)

    def to_bytes(self) -> bytes:
        body = {
            "v": RECORD_VERSION,
            "id": self.namespace.hex(),
            "model": self.model,
            "tenant": self.tenant,
            "layout": self.layout,
            "dtype": self.dtype,
            "world_size": self.world_size,
            "rank": self.rank,
        }
        raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"namespace record of {len(raw)} bytes (model name too long?): at most {MAX_RECORD_BYTES}")
        return raw

    @classmethod
    def from_bytes(cls, namespace: bytes, raw: bytes) -> "NamespaceRecord | None":
        """The record filed under ``namespace``, or None for anything malformed."""
        if len(namespace) != HASH_BYTES or len(raw) > MAX_RECORD_BYTES:
            return None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict) or body.get("v") != RECORD_VERSION or body.get("id") != namespace.hex():
            return None
        text = {k: body.get(k) for k in ("model", "layout", "dtype")}
        ints = {k: body.get(k) for k in ("world_size", "rank")}
        tenant = body.get("tenant")
        if not all(isinstance(v, str) for v in text.values()) or not all(type(v) is int for v in ints.values()):
            return None
        if tenant is not None and not (isinstance(tenant, str) and TENANT_RE.match(tenant)):
            return None
        return cls(namespace, tenant=tenant, **text, **ints)  # type: ignore[arg-type]


def namespace_of(text: str) -> bytes | None:
    """The namespace id ``text`` spells (32 lowercase hex digits), or None: for tiers
    that file a record under a name ending with its id."""
    try:
        ns = bytes.fromhex(text)
    except ValueError:
        return None
    return ns if len(ns) == HASH_BYTES and text == ns.hex() else None


def parse_records(found: Mapping[bytes, bytes]) -> tuple[list[NamespaceRecord], int]:
    """The records that parse, and how many were skipped."""
    records = [r for ns, raw in found.items() if (r := NamespaceRecord.from_bytes(ns, raw)) is not None]
    return records, len(found) - len(records)


def record_in_tiers(tiers: Sequence[Any], writes: Sequence[bool], record: NamespaceRecord) -> None:
    """Give ``record`` to every tier this engine writes to; a tier that fails is
    logged (its chunks are then found only by ``--namespace``), never fatal."""
    raw = record.to_bytes()
    for tier, writable in zip(tiers, writes):
        if not writable:
            continue
        try:
            tier.record_namespace(record.namespace, raw)
        except Exception as err:  # noqa: BLE001 - a record is a convenience for erase, never a reason not to serve
            log.warning(
                "tier %s: could not record key namespace %s (erase --model/--tenant will not find it there): %s",
                getattr(tier, "name", "?"),
                record.namespace.hex(),
                err,
            )
