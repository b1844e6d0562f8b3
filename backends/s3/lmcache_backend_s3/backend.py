"""The S3 tier: chunks as serde frames, one object each, under ``{prefix}/{key}``.

Contract (see :class:`lmcache_core.backend.StorageBackend`):

* ``contains`` costs no request for keys known present (:class:`PresenceCache`) and
  otherwise issues HEADs in parallel waves of ``max_concurrency``, stopping after the
  first wave that holds a miss: never one round trip per key.
* ``get`` decodes with the frame's checksum and expected key: a corrupt, foreign or
  missing object is a miss, never data.
* An unavailable endpoint (refused, timed out, 5xx after botocore's bounded retries)
  is a miss, and the :class:`HealthGate` makes the following calls misses without a
  request until the cooldown passes. Credential or permission failures mid-run raise
  :class:`BackendError` (the engine counts them and treats them as misses).
* Every operation ends within ``op_deadline_s`` whatever the server does (a server
  trickling bytes never trips botocore's per-read timeout): the network part runs on
  a worker the caller stops waiting for at the deadline (see :mod:`.deadline`), and an
  overrun trips the health gate like any other unavailability.
* With ``tenant_quota`` a put takes its bytes from the tenant's ledger first and a
  refusal is a skipped put (see :mod:`.quota`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch
from botocore.exceptions import ClientError

from lmcache_core.backend import (
    BATCHED,
    PERSISTENT,
    SHARED,
    BackendError,
    BackendStats,
    EraseMatch,
    StorageBackend,
    prefix_count,
)
from lmcache_core.keys import ChunkKey
from lmcache_core.namespaces import MAX_RECORD_BYTES, MAX_RECORDS, RECORD_NAME, namespace_of
from lmcache_core.frames import Codec, FrameReader, FrameWriter, Verdict

from .client import Failure, classify, describe, make_client, status_of
from .config import S3Config
from .deadline import DeadlineExceeded, Watchdog, run_bounded
from lmcache_core.health import HealthGate
from .presence import PresenceCache
from .objects import chunk_key, delete_names, get_small, list_page
from .quota import DEFAULT_TIMING, LeaseTiming, TenantQuota
from .transfer import ObjectTooLarge, ranged_get, store

log = logging.getLogger(__name__)


class S3Backend(StorageBackend):
    name = "s3"
    capabilities = frozenset({PERSISTENT, SHARED, BATCHED})

    def __init__(
        self,
        cfg: S3Config,
        *,
        codec: Codec,
        codecs: Mapping[str, Codec],
        client: Any | None = None,
        tenant: str | None = None,
        quota_timing: LeaseTiming = DEFAULT_TIMING,
    ) -> None:
        self.cfg = cfg
        self.codec = codec
        self.codecs = dict(codecs)
        self.client = client if client is not None else make_client(cfg)
        self.endpoint = str(self.client.meta.endpoint_url)
        self.bucket = cfg.bucket
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="lmcache-s3")
        # Whole operations run here (their parts on _pool), so the caller can stop
        # waiting at the deadline; tasks here submit to _pool, never to _ops.
        self._ops = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="lmcache-s3-op")
        # get_many's parallel GETs (each a whole bounded get: they submit to _ops)
        self._batch = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="lmcache-s3-batch")
        self._watchdog = Watchdog()
        self.write_concurrency = cfg.max_concurrency  # the engine's write-behind overlaps PUTs
        self._gate = HealthGate(cfg.down_cooldown_s)
        self._present = PresenceCache(cfg.presence_cache_size, cfg.presence_ttl_s)
        self._lock = threading.Lock()
        self._stats = BackendStats(self.name)
        self._requests = 0
        self._corrupt = 0
        self._overruns = 0
        self._closed = False
        self.op_deadline_s = cfg.op_deadline_s
        self.client.meta.events.register("before-send.s3", self._count_request)
        self.quota: TenantQuota | None = None
        if cfg.tenant_quota is not None:
            self.quota = TenantQuota(self.client, cfg, tenant, self._ops, self._quota_evicted, quota_timing)

    def __repr__(self) -> str:
        return f"S3Backend(bucket={self.bucket!r}, prefix={self.cfg.prefix!r}, endpoint={self.endpoint!r})"

    # -- bookkeeping ----------------------------------------------------------------
    def _count_request(self, **_: Any) -> None:
        with self._lock:
            self._requests += 1

    def _add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _object(self, key: ChunkKey) -> str:
        return self.cfg.object_name(key.to_str())

    def _deadline(self) -> float:
        return time.monotonic() + self.op_deadline_s

    def mark_unavailable(self, op: str, err: BaseException) -> None:
        """Record that ``op`` failed with ``err`` because the endpoint did not answer
        (down, slow past the deadline: :attr:`.client.Failure.UNAVAILABLE`): an error is
        counted and the health gate closes, so calls are misses at once until
        ``down_cooldown_s`` passes (the factory's start-up check uses it too)."""
        was_down = self._gate.down
        self._gate.failed()
        self._add(errors=1)
        if isinstance(err, DeadlineExceeded):
            with self._lock:
                self._overruns += 1
        if not was_down:
            log.warning(
                "s3 tier: %s on bucket %r at %s failed (%s); every call is a miss for the next %.1fs",
                op,
                self.bucket,
                self.endpoint,
                describe(err),
                self.cfg.down_cooldown_s,
            )

    def _raise(self, op: str, key: ChunkKey | None, err: BaseException) -> None:
        """A failure that is not the endpoint being away: count it and raise it."""
        self._gate.succeeded()
        self._add(errors=1)
        what = f" {self._object(key)}" if key is not None else ""
        hint = ""
        if classify(err) is Failure.DENIED:
            hint = "; check the credentials boto3 finds (AWS_* env vars, AWS_PROFILE, instance role) and their permissions"
        raise BackendError(f"s3 {op}{what} in bucket {self.bucket!r} at {self.endpoint}: {describe(err)}{hint}") from None

    # -- lookups --------------------------------------------------------------------
    def _head(self, key: ChunkKey) -> bool:
        """True/False for present/absent; raises on any other outcome."""
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._object(key))
        except Exception as err:
            if classify(err) is Failure.MISSING:
                return False
            raise
        self._present.add(key)
        return True

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        if self._closed or self._gate.blocked():
            return 0  # known present or not, nothing can be read while the endpoint is down
        n = prefix_count(keys, self._present)
        if n == len(keys):
            return n
        if not self._gate.allow():
            return n
        try:
            n = self._probe(keys, n, self._deadline())
        except Exception as err:
            if classify(err) is Failure.UNAVAILABLE:
                self.mark_unavailable("lookup", err)
                return 0
            self._raise("lookup", None, err)
        self._gate.succeeded()
        return n

    def _probe(self, keys: Sequence[ChunkKey], start: int, deadline: float) -> int:
        """HEAD ``keys[start:]`` in parallel, in order, at most ``2 * max_concurrency``
        outstanding; the first absent key ends the count and cancels the HEADs behind it.
        Raises :class:`DeadlineExceeded` at ``deadline``."""
        window = 2 * self.cfg.max_concurrency
        pending: deque[tuple[int, Future[bool] | None]] = deque()
        nxt = start
        try:
            while pending or nxt < len(keys):
                while nxt < len(keys) and len(pending) < window:
                    k = keys[nxt]
                    pending.append((nxt, None if k in self._present else self._pool.submit(self._head, k)))
                    nxt += 1
                i, f = pending.popleft()
                if f is None:
                    continue
                try:
                    present = f.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    raise DeadlineExceeded("lookup did not finish within the operation deadline") from None
                if not present:
                    return i
            return len(keys)
        finally:
            for _, f in pending:
                if f is not None:
                    f.cancel()

    # -- writes ---------------------------------------------------------------------
    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        if key in self._present:
            return True
        if self._closed or not self._gate.allow():
            self._add(skipped=1)
            return False
        name = self._object(key)
        deadline = self._deadline()
        try:
            if self.cfg.check_exists_before_put and run_bounded(self._ops, deadline, "put (exists check)", self._head, key):
                self._gate.succeeded()
                return True
            # Encoded here, not on the worker: a worker abandoned at the deadline must
            # never read ``data`` after the caller has reused its memory.
            frame = FrameWriter.encode(key, data, self.codec)
            upload = partial(run_bounded, self._ops, deadline, "put", self._upload, name, frame, deadline)
            if not (self.quota.write(len(frame), deadline, upload) if self.quota else upload()):  # False: refused
                self._gate.succeeded()
                self._add(skipped=1)
                return False
        except Exception as err:
            if classify(err) is Failure.UNAVAILABLE:
                self.mark_unavailable("put", err)
                self._add(skipped=1)
                return False
            self._raise("put", key, err)
        self._gate.succeeded()
        self._present.add(key)
        self._add(puts=1, put_bytes=data.nbytes)
        return True

    def _upload(self, name: str, frame: bytes, deadline: float) -> bool:
        only_new = self.quota is not None
        return store(self.client, self.bucket, name, frame, self._pool, cfg=self.cfg, deadline=deadline, only_new=only_new)

    def _quota_evicted(self, key: ChunkKey) -> None:  # deleted to make room in the tenant's quota
        self._present.discard(key)
        self._add(evictions=1)
        self.evicted(key)

    def _remove_remote(self, key: ChunkKey) -> bool:
        if not self._head(key):
            return False
        self._present.discard(key)
        self.client.delete_object(Bucket=self.bucket, Key=self._object(key))
        return True

    def remove(self, key: ChunkKey) -> bool:
        if self._closed or not self._gate.allow():
            raise BackendError(f"s3 remove {self._object(key)}: endpoint {self.endpoint} is unavailable")
        self._present.discard(key)
        try:
            removed = run_bounded(self._ops, self._deadline(), "remove", self._remove_remote, key)
        except Exception as err:
            if classify(err) is Failure.UNAVAILABLE:
                self.mark_unavailable("remove", err)
                raise BackendError(f"s3 remove {self._object(key)}: {describe(err)}") from None
            self._raise("remove", key, err)
        self._gate.succeeded()
        return removed

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """List the objects under each of ``match``'s name prefixes (ListObjectsV2,
        1000 names a page) and delete the chunk keys among them (DeleteObjects, up
        to 1000 a request); each request runs under ``op_deadline_s``. Any failure
        raises: an unavailable endpoint, a denied request, or a key the server says it
        did not delete."""
        if self._closed:
            raise BackendError(f"s3 erase in bucket {self.bucket!r}: the tier is closed")
        n = 0
        try:
            for prefix in match.name_prefixes():
                token: str | None = None
                while True:
                    page = run_bounded(self._ops, self._deadline(), "erase (list)", self._list_page, prefix, token)
                    keys = []
                    for item in page.get("Contents", []):
                        key = chunk_key(self.cfg.object_name(""), str(item["Key"]))
                        if key is not None and match(key):
                            keys.append(key)
                    if keys and dry_run:
                        n += len(keys)
                    elif keys:
                        for k in keys:
                            self._present.discard(k)
                        run_bounded(self._ops, self._deadline(), "erase (delete)", self._delete_batch, keys)
                        n += len(keys)
                        if progress is not None:
                            progress(n)
                    if not page.get("IsTruncated"):
                        break
                    token = str(page["NextContinuationToken"])
        except BackendError:
            raise
        except Exception as err:
            if classify(err) is Failure.UNAVAILABLE:
                self.mark_unavailable("erase", err)
                raise BackendError(f"s3 erase in bucket {self.bucket!r} at {self.endpoint}: {describe(err)}") from None
            self._raise("erase", None, err)
        self._gate.succeeded()
        return n

    def record_namespace(self, namespace: bytes, record: bytes) -> None:
        """One small object, ``<prefix>/lmcache-ns-<id>``, next to the chunks (their
        names start with ``v1-``), under ``op_deadline_s``; raises on failure."""
        if self._closed:
            raise BackendError(f"s3 record in bucket {self.bucket!r}: the tier is closed")
        name = self.cfg.object_name(RECORD_NAME + namespace.hex())
        try:
            run_bounded(self._ops, self._deadline(), "record", self.client.put_object, Bucket=self.bucket, Key=name, Body=record)
        except Exception as err:
            raise BackendError(f"s3 record {name} in bucket {self.bucket!r} at {self.endpoint}: {describe(err)}") from None

    def namespace_records(self) -> dict[bytes, bytes]:
        """ListObjectsV2 under ``<prefix>/lmcache-ns-``, then one ranged GET of at
        most 4 KiB per record (a larger object is skipped), each under ``op_deadline_s``."""
        if self._closed:
            raise BackendError(f"s3 records in bucket {self.bucket!r}: the tier is closed")
        out: dict[bytes, bytes] = {}
        head = self.cfg.object_name(RECORD_NAME)
        token: str | None = None
        try:
            while len(out) < MAX_RECORDS:
                page = run_bounded(self._ops, self._deadline(), "records (list)", self._list_page, RECORD_NAME, token)
                for item in page.get("Contents", []):
                    name, size = str(item["Key"]), int(item.get("Size", 0))
                    ns = namespace_of(name[len(head) :]) if name.startswith(head) else None
                    if ns is not None and size <= MAX_RECORD_BYTES and len(out) < MAX_RECORDS:
                        out[ns] = run_bounded(self._ops, self._deadline(), "records (get)", self._get_small, name)
                if not page.get("IsTruncated"):
                    break
                token = str(page["NextContinuationToken"])
        except Exception as err:
            raise BackendError(f"s3 records in bucket {self.bucket!r} at {self.endpoint}: {describe(err)}") from None
        return out

    def _get_small(self, name: str) -> bytes:
        return get_small(self.client, self.bucket, name, MAX_RECORD_BYTES + 1)[0]

    def _list_page(self, prefix: str, token: str | None) -> Any:
        return list_page(self.client, self.bucket, self.cfg.object_name(prefix), token)

    def _delete_batch(self, keys: list[ChunkKey]) -> None:
        errors = delete_names(self.client, self.bucket, [self._object(k) for k in keys])
        if errors:
            first = errors[0]
            raise BackendError(
                f"s3 erase in bucket {self.bucket!r}: {len(errors)} object(s) not deleted, "
                f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}".rstrip()
            )

    # -- reads ----------------------------------------------------------------------
    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        if self._closed or not self._gate.allow():
            self._add(misses=1)
            return False
        # Bound what we accept before reading: header, plus the payload of the largest
        # codec output for ``out`` (LZ4's worst case on incompressible data).
        max_bytes = FrameReader.max_frame_len(out)
        deadline = self._deadline()
        try:
            # The worker returns fresh bytes; only this thread writes into ``out``.
            frame = run_bounded(
                self._ops,
                deadline,
                "get",
                ranged_get,
                self.client,
                self.bucket,
                self._object(key),
                self._pool,
                range_size=self.cfg.range_chunksize,
                max_bytes=max_bytes,
                deadline=deadline,
                watchdog=self._watchdog,
            )
        except ObjectTooLarge as err:
            self._gate.succeeded()
            log.debug("s3 get %s: %s", self._object(key), err)
            self._add(misses=1)
            return False
        except Exception as err:
            kind = classify(err)
            if isinstance(err, ClientError) and status_of(err) == 416:  # an empty object has no byte 0
                self._gate.succeeded()
                self._bad_frame(key, Verdict.CORRUPT, "empty object")
                return False
            if kind is Failure.MISSING:
                self._gate.succeeded()
                self._present.discard(key)
                self._add(misses=1)
                return False
            if kind is Failure.UNAVAILABLE:
                self.mark_unavailable("get", err)
                self._add(misses=1)
                return False
            self._raise("get", key, err)
        self._gate.succeeded()
        decoded = FrameReader(self.codecs).decode(frame, key=key, out=out)
        if decoded.verdict is not Verdict.OK:
            self._bad_frame(key, decoded.verdict, decoded.reason or "undecodable")
            return False
        self._present.add(key)
        self._add(hits=1, get_bytes=out.nbytes)
        return True

    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """GETs in parallel (``max_concurrency`` at a time, each bounded by the operation
        deadline): a batch costs about one round trip per ``max_concurrency`` chunks.
        A key whose GET fails is a miss; the others are unaffected."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output tensors")
        if len(keys) <= 1:
            return [self.get(k, o) for k, o in zip(keys, outs)]

        def one(k: ChunkKey, o: torch.Tensor) -> bool:
            try:
                return self.get(k, o)
            except BackendError as err:
                log.debug("s3 get %s in a batch: %s", self._object(k), err)
                return False

        return list(self._batch.map(one, keys, outs))

    def _bad_frame(self, key: ChunkKey, verdict: Verdict, reason: str) -> None:
        """An object that did not decode into the caller's chunk: a miss. Of another
        shape or dtype (``WRONG_SHAPE``: the object may be fine) it is left alone;
        corrupt or not ours, it is counted (``corrupt``). With ``delete_corrupt`` a
        damaged one (``CORRUPT``) is deleted, within the operation deadline; a
        well-formed frame this reader does not take (``FOREIGN``: another frame
        format, a codec or dtype not installed here, another seal, another key's
        frame) is kept: another reader of the bucket may take it."""
        self._add(misses=1)
        if verdict is Verdict.WRONG_SHAPE:
            log.debug("s3 get %s: %s", self._object(key), reason)
            return
        self._present.discard(key)
        with self._lock:
            self._corrupt += 1
        log.warning(
            "s3 tier: object %s in bucket %r is not a valid frame for its key (%s); treated as a miss",
            self._object(key),
            self.bucket,
            reason,
        )
        if self.cfg.delete_corrupt and verdict is Verdict.CORRUPT:
            try:
                run_bounded(
                    self._ops,
                    self._deadline(),
                    "delete corrupt",
                    self.client.delete_object,
                    Bucket=self.bucket,
                    Key=self._object(key),
                )
            except Exception as err:
                if classify(err) is Failure.UNAVAILABLE:  # cut at the deadline, or the endpoint is down
                    self.mark_unavailable("delete corrupt", err)
                log.warning("s3 tier: could not delete corrupt object %s: %s", self._object(key), describe(err))

    # -- housekeeping ---------------------------------------------------------------
    def stats(self) -> BackendStats:
        with self._lock:
            s = self._stats.snapshot()
            s.extra.update(
                requests=self._requests,
                corrupt=self._corrupt,
                deadline_overruns=self._overruns,
                op_deadline_s=self.op_deadline_s,
                known_present=len(self._present),
                endpoint_down=self._gate.down,
                endpoint_trips=self._gate.trips,
                bucket=self.bucket,
                prefix=self.cfg.prefix,
                endpoint=self.endpoint,
            )
        if self.quota is not None:
            self.quota.report(s)
        return s

    def check_bucket(self) -> None:
        """One HeadBucket request within the operation deadline; raises its error as
        botocore gives it (or :class:`DeadlineExceeded`)."""
        run_bounded(self._ops, self._deadline(), "bucket check", self.client.head_bucket, Bucket=self.bucket)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.quota is not None and not self._gate.down:  # else its leases expire
            self.quota.close(self._deadline())
        self._batch.shutdown(wait=False, cancel_futures=True)
        self._ops.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._watchdog.close()
        try:
            self.client.close()
        except Exception as err:  # closing twice or a dead socket: nothing to do
            log.debug("s3 tier: client close: %s", err)
