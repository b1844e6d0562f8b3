"""Requests on objects by name that the tier's parts share: listing and deleting
(``erase``, the quota's reconcile), conditional and small PUTs and small GETs (namespace
records, the quota's ledger). Each caller runs them under its own deadline."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError

from lmcache_core.keys import ChunkKey

from .client import status_of

PAGE = 1000
"""Names a ListObjectsV2 page holds and a DeleteObjects request takes, at most."""


def list_page(client: Any, bucket: str, prefix: str, token: str | None) -> Any:
    """One ListObjectsV2 page of the names starting with ``prefix``."""
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": PAGE}
    if token is not None:
        kw["ContinuationToken"] = token
    return client.list_objects_v2(**kw)


def delete_names(client: Any, bucket: str, names: list[str]) -> list[dict[str, Any]]:
    """One DeleteObjects request (at most :data:`PAGE` names); the errors it reports,
    one per name the server did not delete."""
    reply = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": n} for n in names], "Quiet": True})
    return list(reply.get("Errors") or [])


def chunk_key(head: str, name: str) -> ChunkKey | None:
    """The chunk key the object ``name`` stands for under ``head`` (the prefix and its
    slash), or None: a namespace record, the quota's ledger, a foreign name."""
    if not name.startswith(head):
        return None
    try:
        return ChunkKey.parse(name[len(head) :])
    except ValueError:
        return None


def precondition_failed(err: BaseException) -> bool:
    """A conditional PUT that lost: 412 (the condition did not hold) or 409 (a
    concurrent conditional write of the same name)."""
    return isinstance(err, ClientError) and status_of(err) in (409, 412)


def put_new(client: Any, bucket: str, name: str, body: bytes) -> bool:
    """PUT ``name`` only if no object has it (``If-None-Match: *``); False if one did."""
    try:
        client.put_object(Bucket=bucket, Key=name, Body=body, IfNoneMatch="*")
    except ClientError as err:
        if precondition_failed(err):
            return False
        raise
    return True


def get_small(client: Any, bucket: str, name: str, limit: int) -> tuple[bytes, str]:
    """At most ``limit`` bytes of ``name`` (one ranged GET) and its ETag."""
    reply = client.get_object(Bucket=bucket, Key=name, Range=f"bytes=0-{limit - 1}")
    return bytes(reply["Body"].read(limit)), str(reply.get("ETag", ""))
