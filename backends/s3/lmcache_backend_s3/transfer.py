"""Moving one object's bytes: parallel ranged GETs and multipart uploads.

A GET always asks for the first ``range_size`` bytes; the ``Content-Range`` answer
gives the object's size, so a chunk that fits costs one request and a larger one is
fetched as parallel ranges (pinned to the first response's ETag, so a concurrent
overwrite cannot splice two versions). Frames at or above the multipart threshold are
uploaded as parallel parts; a failed upload is aborted so no parts are left billed.
Parts run on the caller-given executor, whose tasks never submit further tasks;
:func:`store` picks one PUT or a multipart upload for a frame. Everything runs against one absolute deadline (``time.monotonic()``); with a
:class:`~.deadline.Watchdog`, a body still being read at the deadline is cut.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Executor, Future, wait
from contextlib import nullcontext
from typing import Any, ContextManager

from .config import MAX_PARTS, S3Config
from .deadline import DeadlineExceeded, Watchdog
from .objects import put_new

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class ObjectTooLarge(Exception):
    """The object is larger than the caller's buffer could ever need: not our chunk."""


def _wait_all(futures: list[Future[Any]], deadline: float) -> None:
    done, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
    if pending:
        for f in pending:
            f.cancel()
        raise DeadlineExceeded(f"{len(pending)} of {len(futures)} transfers did not finish before the deadline")
    for f in done:
        f.result()


def read_at_most(body: Any, limit: int) -> bytes:
    """The bytes of a response ``body`` up to its end or ``limit`` + 1 of them,
    whichever comes first (one more than ``limit`` says there was more): the memory
    a read takes is bounded by what the caller expects, not by what the peer sends."""
    parts: list[bytes] = []
    have = 0
    while have <= limit:
        piece = body.read(limit + 1 - have)
        if not piece:
            break
        parts.append(piece)
        have += len(piece)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def ranged_get(
    client: Any,
    bucket: str,
    name: str,
    pool: Executor,
    *,
    range_size: int,
    max_bytes: int,
    deadline: float,
    watchdog: Watchdog | None = None,
) -> bytes | bytearray:
    """The whole object ``name``; raises botocore errors, ``ObjectTooLarge`` or ``TimeoutError``."""

    def guard(b: Any) -> ContextManager[None]:
        return watchdog.guard_body(b, deadline) if watchdog is not None else nullcontext()

    first = client.get_object(Bucket=bucket, Key=name, Range=f"bytes=0-{range_size - 1}")
    body = first["Body"]
    try:
        m = _CONTENT_RANGE.match(first.get("ContentRange") or "")
        total = int(m.group(3)) if m else int(first.get("ContentLength") or 0)
        if total > max_bytes or int(first.get("ContentLength") or 0) > max_bytes:
            raise ObjectTooLarge(f"object has {total} bytes, at most {max_bytes} expected")
        with guard(body):
            # At most max_bytes + 1 whatever the headers said: a response without a
            # Content-Length (chunked) passes the check above with any length.
            head = read_at_most(body, max_bytes)
    finally:
        body.close()
    if len(head) > max_bytes:
        raise ObjectTooLarge(f"object has more than {max_bytes} bytes")
    if len(head) >= total:
        return head
    etag = first.get("ETag")
    buf = bytearray(total)
    view = memoryview(buf)
    view[: len(head)] = head

    def fetch(lo: int, hi: int) -> None:
        kw = {"IfMatch": etag} if etag else {}
        r = client.get_object(Bucket=bucket, Key=name, Range=f"bytes={lo}-{hi - 1}", **kw)
        part = r["Body"]
        try:
            with guard(part):
                data = read_at_most(part, hi - lo)
        finally:
            part.close()
        if len(data) != hi - lo:
            raise IOError(f"range {lo}-{hi - 1} returned {len(data)} bytes")
        view[lo:hi] = data

    futures = [pool.submit(fetch, lo, min(lo + range_size, total)) for lo in range(len(head), total, range_size)]
    _wait_all(futures, deadline)
    return buf


def multipart_put(
    client: Any,
    bucket: str,
    name: str,
    data: bytes,
    pool: Executor,
    *,
    part_size: int,
    deadline: float,
) -> int:
    """Upload ``data`` in parallel parts; returns the number of parts. Aborts on failure."""
    part_size = max(part_size, -(-len(data) // MAX_PARTS))
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]
    try:
        view = memoryview(data)

        def upload(number: int, lo: int) -> dict[str, Any]:
            r = client.upload_part(
                Bucket=bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=bytes(view[lo : lo + part_size])
            )
            return {"PartNumber": number, "ETag": r["ETag"]}

        futures = [pool.submit(upload, i + 1, lo) for i, lo in enumerate(range(0, len(data), part_size))]
        _wait_all(futures, deadline)
        parts = [f.result() for f in futures]
        client.complete_multipart_upload(Bucket=bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts})
        return len(parts)
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload_id)
        except Exception:  # the original error is the one to report
            pass
        raise


def store(
    client: Any, bucket: str, name: str, frame: bytes, pool: Executor, *, cfg: S3Config, deadline: float, only_new: bool
) -> bool:
    """Upload ``frame`` as ``name``: multipart from ``cfg.multipart_threshold`` on, else one
    PUT. With ``only_new`` (a tenant quota is kept) that PUT carries ``If-None-Match: *``:
    False means the object was already there and nothing was written (so its bytes are
    never counted twice); a multipart upload is counted whatever it replaces."""
    if len(frame) >= cfg.multipart_threshold:
        multipart_put(client, bucket, name, frame, pool, part_size=cfg.multipart_chunksize, deadline=deadline)
    elif only_new:
        return put_new(client, bucket, name, frame)
    else:
        client.put_object(Bucket=bucket, Key=name, Body=frame)
    return True
