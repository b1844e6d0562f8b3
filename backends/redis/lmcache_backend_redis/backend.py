"""The Redis tier: one string value per chunk, a serde frame, under ``{prefix}{key}``.

Contract (see :class:`lmcache_core.backend.StorageBackend`):

* Batched calls are pipelines: ``contains`` sends one ``EXISTS`` per key, ``get_many``
  one ``STRLEN`` + ``GETRANGE`` pair per key, ``put_many`` (after an ``EXISTS``
  pipeline) one ``SET`` per missing key (on a single server with the frame's header
  and payload as separate buffers, see :mod:`.wire`). A pipeline is one round trip on
  a single server, and one round trip per node on a cluster (redis-py groups the
  commands by slot owner). ``get`` and ``put`` are one-element batches.
* Reads are bounded: ``GETRANGE`` asks for at most the largest frame the caller's
  buffer could need, so a huge or foreign value never costs more memory than the
  chunk; a value that fails its checksum, names another key or is not a frame is a miss.
* Frames larger than ``max_value_size`` are refused (the put is skipped and counted),
  never split: a chunk is one value, so it is present or absent as a whole.
* The server's memory limit is the tier's: an ``OOM`` reply (``maxmemory`` reached
  under ``noeviction``) is a skipped put, counted in ``extra["oom"]``.
* Every call ends within ``call_timeout_s``, whatever the server or the link does
  (a reply trickled a few bytes at a time, a reply cut off and retried): see
  :func:`~.client.call_deadline`.
* A server that is down, slow past ``socket_timeout_s`` / ``call_timeout_s``,
  loading, or a cluster whose slots are not served makes the call a miss, and the :class:`HealthGate` makes the
  following calls misses without a request until ``down_cooldown_s`` passes. Wrong
  credentials or missing ACL permissions mid-run raise :class:`BackendError` (the
  engine counts it and treats it as a miss).
* With ``tenant_quota`` every put goes through the tenant's ledger (a single server:
  one transaction, :mod:`.quota`; a cluster: reserve, delete and store, confirm,
  :mod:`.cluster_quota`): the tenant's oldest chunks are deleted to make room
  (reported as evictions), so its bytes never pass the quota, whatever its other
  engines do; a chunk larger than the quota is refused (counted); ``remove`` and
  ``erase`` keep the ledgers true.
* What the server evicts (``maxmemory``) or expires (``ttl_s``) is reported to the
  engine's listeners (KV events) once the engine subscribes
  (:meth:`subscribe_evictions`, on its first listener): a :class:`~.events.KeyEventWatcher`
  subscribes to the server's keyspace notifications (``eviction_events``); names
  under this tier's ``prefix`` that are chunk keys and that the server no longer
  holds (checked with ``EXISTS``: anyone may publish on those channels) become
  :meth:`~lmcache_core.backend.StorageBackend.evicted` calls; any other name is
  ignored (counted). The watcher reads at most ``max_key_events_per_s`` names in any
  second and pauses its subscription for the rest of a second that brings more (a
  flood: bounded work, and what it drops costs later misses, never wrong KV).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import redis
import torch

from lmcache_core.backend import BATCHED, PERSISTENT, SHARED, BackendError, BackendStats, EraseMatch, StorageBackend
from lmcache_core.keys import ChunkKey
from lmcache_core.namespaces import MAX_RECORD_BYTES, MAX_RECORDS, RECORD_NAME, namespace_of
from lmcache_core.frames import Codec, FrameReader, FrameWriter, Verdict

from .client import Client, Failure, call_deadline, classify, describe, make_client
from .config import RedisConfig
from .events import KeyEventWatcher
from lmcache_core.health import HealthGate
from . import cluster_quota
from .cluster_quota import ClusterLedger
from .quota import FORGET_SCRIPT, PUT_REPLIES, PutOutcome, TenantLedger, ledger_pattern, read_put_reply
from .wire import pipelined, read_ranges, set_command

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0

QUOTA_SKIPPED = object()
"""A cluster quota put's reply for a chunk not sent (refused, or still waiting for
room): a skipped put, counted in ``quota_refused``."""
QUOTA_IN_FLIGHT = object()
"""A cluster quota put's reply for a chunk another writer of the tenant is storing at
that moment: not sent, a skipped put, counted in ``quota_in_flight``."""


#: names per SCAN step and per pipeline of DELs in :meth:`RedisBackend.erase`
ERASE_BATCH = 500
#: tenant ledgers (``tenant_quota``) an erase updates at most
MAX_LEDGERS = 1024


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN's MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def max_frame_bytes(out: torch.Tensor) -> int:
    """The largest frame that can decode into ``out``: header, plus the payload of the
    largest codec output for it (LZ4's worst case on incompressible data)."""
    return FrameReader.max_frame_len(out)


class _Judged(NamedTuple):
    """One key's read: ``verdict`` OK (decoded into the caller's tensor), another
    :class:`Verdict` (a value that is not this chunk's frame), or None for a miss
    (``reason`` set when the server answered with an error)."""

    verdict: Verdict | None
    reason: str = ""


_HIT = _Judged(Verdict.OK)
_MISS = _Judged(None)


def _join(header: bytes, payload: memoryview) -> memoryview:
    """The frame as one buffer, built with a single copy of the payload."""
    buf = bytearray(len(header) + payload.nbytes)
    buf[: len(header)] = header
    buf[len(header) :] = payload
    return memoryview(buf)


class RedisBackend(StorageBackend):
    name = "redis"
    capabilities = frozenset({PERSISTENT, SHARED, BATCHED})

    def __init__(
        self,
        cfg: RedisConfig,
        *,
        codec: Codec,
        codecs: Mapping[str, Codec],
        password: str | None = None,
        client: Client | None = None,
        tenant: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.codec = codec
        self.codecs = dict(codecs)
        self.target = cfg.target()
        self.write_concurrency = cfg.write_concurrency
        self._password = password
        self._ttl_ms = int(cfg.ttl_s * 1000) if cfg.ttl_s is not None else None
        self._gate = HealthGate(cfg.down_cooldown_s)
        self._lock = threading.Lock()
        self._client_lock = threading.Lock()
        self._stats = BackendStats(self.name, extra={"oom": 0, "too_large": 0, "corrupt": 0, "pipelines": 0})
        self.ledger = self._ledger(tenant)
        self._last_log: dict[str, float] = {}  # _log_due: when each kind of warning was last logged
        self._closed = False
        self.watcher: KeyEventWatcher | None = None
        self.client: Client | None = client
        if client is None:
            try:
                self.client = make_client(cfg, password)
            except Exception as err:
                # A cluster client maps the slots when it is built. No seed answering: the
                # tier starts as down and builds the client on a later call. Any other
                # failure (credentials) recurs on the first call (the startup PING), which
                # reports it with the config keys to fix.
                if classify(err) is Failure.UNAVAILABLE:
                    self._failed("connect", err)
        # A single server's pool takes our zero-copy SETs; a cluster client routes itself.
        self._single_pool = self.client.connection_pool if isinstance(self.client, redis.Redis) else None
        if isinstance(self.ledger, TenantLedger) and self._single_pool is None:
            raise ValueError("tenant_quota with url needs a single server's client (redis.Redis), not a cluster's")

    def __repr__(self) -> str:
        return f"RedisBackend({self.target!r}, prefix={self.cfg.prefix!r})"

    def _ledger(self, tenant: str | None) -> TenantLedger | ClusterLedger | None:
        """The tenant's ledger when ``tenant_quota`` is set (see :mod:`.quota` and
        :mod:`.cluster_quota`)."""
        if self.cfg.tenant_quota is None:
            return None
        if tenant is None:
            raise ValueError("tenant_quota needs the engine's tenant label (the top-level tenant key)")
        self._stats.bytes_capacity = self.cfg.tenant_quota
        self._stats.extra.update(quota_tenant=tenant, quota_refused=0, quota_evictions=0)
        if self.cfg.cluster is not None:
            self._stats.extra["quota_in_flight"] = 0
            lease_ms = max(cluster_quota.LEASE_MS, int(4000 * self.cfg.call_timeout_s))
            return ClusterLedger(self.cfg.prefix, tenant, self.cfg.tenant_quota, self._ttl_ms, lease_ms)
        return TenantLedger(self.cfg.prefix, tenant, self.cfg.tenant_quota, self._ttl_ms)

    # -- what the server drops -------------------------------------------------------
    def subscribe_evictions(self, callback: Callable[[ChunkKey], None]) -> None:
        """Called by the engine once someone listens (KV events on): only then subscribe
        to the server's keyspace notifications (``eviction_events``)."""
        super().subscribe_evictions(callback)
        if self.cfg.eviction_events and self.watcher is None and not self._closed:
            self.watcher = KeyEventWatcher(
                self.cfg,
                self._password,
                self._key_events,
                retry_s=max(self.cfg.down_cooldown_s, 1.0),
                on_flood=self._flood_warning,
            )
            # Subscribed before the first store can be evicted (bounded: a server down now is read once it answers).
            self.watcher.settled.wait(min(self.cfg.socket_timeout_s, 2.0))

    def _key_events(self, batch: list[tuple[bytes, str]]) -> None:
        """One wake-up's names from the key-event channels (at most
        ``max_key_events_per_s`` a second, the watcher's bound): ours (prefix, chunk
        key) and gone from the server are reported as evicted."""
        ours: list[tuple[ChunkKey, str]] = []
        foreign = 0
        for name, event in batch:
            key = self._chunk_of(name)
            if key is None:  # another application's name, a namespace record, a quota ledger
                foreign += 1
                continue
            ours.append((key, event))
        if foreign:
            self._add(foreign_key_events=foreign)
        if not ours:
            return
        try:
            with self._deadline():
                pipe = self._pipeline()
                for key, _ in ours:
                    pipe.exists(self._name(key))
                present = pipe.execute()
        except Exception as err:  # cannot check now: report nothing rather than a guess
            self._add(key_events_unchecked=len(ours))
            log.debug("redis tier: key events not checked: %s", describe(err))
            return
        for (key, event), there in zip(ours, present):
            if there:
                self._add(key_events_present=1)  # forged, or the key was stored again since
                continue
            self._add(**{f"server_{event}": 1})
            self.evicted(key)

    def _log_due(self, kind: str) -> bool:
        """True at most once every ``_LOG_EVERY_S`` per ``kind`` of warning: a flood of
        key events or a full server logs one line a minute, not one per event."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_log.get(kind, -_LOG_EVERY_S) < _LOG_EVERY_S:
                return False
            self._last_log[kind] = now
            return True

    def _flood_warning(self) -> None:
        """The watcher read more than ``max_key_events_per_s`` names in one second and
        pauses until it ends (logged at most once a minute)."""
        if self._log_due("flood"):
            log.warning(
                "redis tier: more than %d key events in one second on %s: a flood of keyspace notifications "
                "(possibly forged by another client); the subscription pauses for the rest of each such second and "
                "what the server publishes meanwhile is dropped (evictions may go unreported: later misses, never "
                "wrong KV; extra['key_event_pauses'] counts the pauses)",
                self.cfg.max_key_events_per_s,
                self.target,
            )

    # -- bookkeeping ----------------------------------------------------------------
    def _add(self, **counts: int) -> None:
        with self._lock:
            self._stats.add(**counts)

    def _name(self, key: ChunkKey) -> str:
        return self.cfg.prefix + key.to_str()

    def _open(self) -> bool:
        return not self._closed and self._gate.allow()

    def mark_available(self) -> None:
        """Record that the server answered (a call, or the factory's start-up check):
        the health gate opens, if it was closed."""
        if self._gate.succeeded():
            log.warning("redis tier: %s answers again; lookups and stores resume", self.target)

    def mark_unavailable(self, op: str, err: BaseException) -> None:
        """Record that ``op`` failed with ``err`` because the server did not answer
        (down, slow, loading: :attr:`.client.Failure.UNAVAILABLE`): an error is counted
        and the health gate closes, so calls are misses at once until
        ``down_cooldown_s`` passes (the factory's start-up check uses it too)."""
        self._add(errors=1)
        if self._gate.failed():
            log.warning(
                "redis tier: %s on %s failed (%s); every call is a miss for the next %.1fs",
                op,
                self.target,
                describe(err),
                self.cfg.down_cooldown_s,
            )

    def _failed(self, op: str, err: BaseException) -> None:
        """Sort a failed call: unavailable -> close the gate (the caller returns a miss);
        credentials or anything unexpected -> raise :class:`BackendError`."""
        kind = classify(err)
        if kind is Failure.UNAVAILABLE:
            self.mark_unavailable(op, err)
            return
        self._add(errors=1)
        self._gate.succeeded()
        hint = ""
        if kind is Failure.DENIED:
            hint = (
                "; check username / password / password_file (or the url's user:password) and that the ACL user "
                "may run EXISTS, GET, GETRANGE, STRLEN, SET, DEL on the prefix's keys (with tenant_quota also MULTI, EXEC, "
                "EVAL, EVALSHA, TIME and the sorted-set and hash commands of its scripts)"
            )
        raise BackendError(f"redis {op} on {self.target}: {describe(err)}{hint}") from None

    def _conn(self) -> Client:
        """The client, built now if the servers did not answer when the tier started."""
        if self.client is None:
            with self._client_lock:
                if self.client is None:
                    self.client = make_client(self.cfg, self._password)
        return self.client

    def _deadline(self) -> Any:
        """The deadline every call runs under (``call_timeout_s``)."""
        return call_deadline(self.cfg.call_timeout_s)

    def _pipeline(self) -> Any:
        self._add(pipelines=1)
        return self._conn().pipeline(transaction=False)

    # -- lookups --------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        if not keys or not self._open():
            return 0
        try:
            with self._deadline():
                pipe = self._pipeline()
                for k in keys:
                    pipe.exists(self._name(k))
                found = pipe.execute()
        except Exception as err:
            self._failed("lookup", err)
            return 0
        self.mark_available()
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    # -- reads ----------------------------------------------------------------------
    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        return self.get_many([key], [out])[0]

    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Fill each ``outs[i]`` with ``keys[i]``'s chunk in one pipeline; per key,
        True for a hit. Holds at most one bounded frame per key in memory at once."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output tensors")
        hits = [False] * len(keys)
        if not keys:
            return hits
        if not self._open():
            self._add(misses=len(keys))
            return hits
        judged: list[_Judged] = [_MISS] * len(keys)
        try:
            with self._deadline():
                if self._single_pool is not None:  # replies parsed by wire.read_ranges, each judged as it arrives
                    self._add(pipelines=1)
                    names = [self._name(k).encode() for k in keys]

                    def each(i: int, size: Any, frame: Any) -> None:
                        judged[i] = self._judge(keys[i], outs[i], size, frame)

                    read_ranges(self._single_pool, names, [max_frame_bytes(out) for out in outs], each)
                else:
                    pipe = self._pipeline()
                    for k, out in zip(keys, outs):
                        name = self._name(k)
                        pipe.strlen(name)
                        pipe.getrange(name, 0, max_frame_bytes(out) - 1)
                    replies = pipe.execute(raise_on_error=False)
                    judged = [
                        self._judge(k, out, replies[2 * i], replies[2 * i + 1]) for i, (k, out) in enumerate(zip(keys, outs))
                    ]
        except Exception as err:
            self._add(misses=len(keys))
            self._failed("get", err)
            return hits
        self.mark_available()
        for i, (k, out) in enumerate(zip(keys, outs)):
            hits[i] = self._account(k, out, judged[i])
        return hits

    def _judge(self, key: ChunkKey, out: torch.Tensor, size: Any, frame: Any) -> _Judged:
        """What one ``STRLEN`` + ``GETRANGE`` reply pair says, decoding a good frame
        into ``out``. Only records: counting and logging wait for :meth:`_account`
        (a read retried on a fresh connection judges the same key twice)."""
        for reply in (size, frame):
            if isinstance(reply, BaseException):
                if str(reply).startswith("WRONGTYPE"):
                    return _Judged(Verdict.CORRUPT, "not a string value")
                return _Judged(None, describe(reply))
        if not size:
            return _MISS
        if size > max_frame_bytes(out):
            # Only a prefix was read. Longer than any frame for ``out``: a frame of
            # another shape if its header says so, else damaged (or not ours).
            verdict = FrameReader(self.codecs).verdict(frame, size, key=key, out=out)
            return _Judged(
                Verdict.CORRUPT if verdict is Verdict.OK else verdict,
                f"{size} bytes, more than a frame for this chunk can have",
            )
        decoded = FrameReader(self.codecs).decode(frame, key=key, out=out)
        if decoded.verdict is not Verdict.OK:
            return _Judged(decoded.verdict, decoded.reason or "undecodable")
        return _HIT

    def _account(self, key: ChunkKey, out: torch.Tensor, judged: _Judged) -> bool:
        """Count (and log) one judged reply; True for a hit."""
        if judged.verdict is Verdict.OK:
            self._add(hits=1, get_bytes=out.nbytes)
            return True
        if judged.verdict is None:
            if judged.reason:  # an error reply for this key
                self._add(misses=1, errors=1)
                log.debug("redis get %s: %s", self._name(key), judged.reason)
            else:
                self._add(misses=1)
            return False
        self._bad_value(key, judged.verdict, judged.reason)
        return False

    def _bad_value(self, key: ChunkKey, verdict: Verdict, reason: str) -> None:
        """A value that did not decode into the caller's chunk: a miss. Of another shape
        or dtype (``WRONG_SHAPE``: the value may be fine) it is left alone; corrupt or
        not ours, it is counted (``corrupt``). With ``delete_corrupt`` a damaged one
        (``CORRUPT``) is deleted; a well-formed frame this reader does not take
        (``FOREIGN``: another frame format, a codec or dtype not installed here,
        another seal, another key's frame) is kept: another reader may take it."""
        self._add(misses=1)
        if verdict is Verdict.WRONG_SHAPE:
            log.debug("redis get %s: %s", self._name(key), reason)
            return
        self._add(corrupt=1)
        log.warning(
            "redis tier: value %s on %s is not a valid frame for its key (%s); treated as a miss",
            self._name(key),
            self.target,
            reason,
        )
        if self.cfg.delete_corrupt and verdict is Verdict.CORRUPT:
            try:
                with self._deadline():
                    self._conn().delete(self._name(key))
            except Exception as err:
                log.warning("redis tier: could not delete corrupt value %s: %s", self._name(key), describe(err))

    # -- writes ---------------------------------------------------------------------
    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        return self.put_many([(key, data)])[0]

    def put_many(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[bool]:
        """Store chunks with at most two pipelines (``EXISTS``, then ``SET`` for the
        missing ones); per item, True if the chunk is now stored (or already was)."""
        done = [False] * len(items)
        if not items:
            return done
        if not self._open():
            self._add(skipped=len(items))
            return done
        try:
            with self._deadline():
                frames, replies = self._send_puts(items, done)
        except Exception as err:
            self._add(skipped=sum(1 for d in done if not d))
            self._failed("put", err)
            return done
        self.mark_available()
        for (i, _, _), reply in zip(frames, replies):
            if reply is QUOTA_SKIPPED or reply is QUOTA_IN_FLIGHT:
                self._add(skipped=1, **{"quota_refused" if reply is QUOTA_SKIPPED else "quota_in_flight": 1})
                continue
            if isinstance(reply, BaseException):
                self._put_refused(items[i][0], reply)
                continue
            done[i] = True
            self._add(puts=1, put_bytes=items[i][1].nbytes)
        return done

    def _send_puts(
        self, items: Sequence[tuple[ChunkKey, torch.Tensor]], done: list[bool]
    ) -> tuple[list[tuple[int, bytes, memoryview]], list[Any]]:
        """:meth:`put_many`'s round trips: the ``EXISTS`` pipeline (marking present
        items in ``done``), then the ``SET``s of the rest; returns what was sent and
        the replies."""
        todo = list(range(len(items)))
        if self.cfg.check_exists_before_put:
            pipe = self._pipeline()
            for k, _ in items:
                pipe.exists(self._name(k))
            present = pipe.execute()
            todo = [i for i in todo if not present[i]]
            for i in range(len(items)):
                done[i] = bool(present[i])
        frames: list[tuple[int, bytes, memoryview]] = []
        for i in todo:
            k, data = items[i]
            header, payload = FrameWriter(k, data, self.codec).parts()
            if len(header) + payload.nbytes > self.cfg.max_value_size:
                self._too_large(k, len(header) + payload.nbytes)
                continue
            if self.ledger is not None and len(header) + payload.nbytes > self.ledger.quota:
                self._over_quota(k, len(header) + payload.nbytes)
                continue
            frames.append((i, header, payload))
        replies = self._set_all([(self._name(items[i][0]), h, p) for i, h, p in frames]) if frames else []
        return frames, replies

    def _set_all(self, values: list[tuple[str, bytes, memoryview]]) -> list[Any]:
        """``SET`` every ``(name, header, payload)`` in one pipeline (with a quota, in
        the tenant's transactions: :meth:`_set_within_quota`); per value, the reply or
        the error reply as an exception."""
        self._add(pipelines=1)
        if isinstance(self.ledger, ClusterLedger):
            return self._set_within_cluster_quota(self.ledger, values)
        if self.ledger is not None:
            return self._set_within_quota(self.ledger, values)
        if self._single_pool is not None:
            cmds = [set_command(name.encode(), h, p, self._ttl_ms) for name, h, p in values]
            return pipelined(self._single_pool, cmds)
        pipe = self._conn().pipeline(transaction=False)
        for name, h, p in values:
            pipe.set(name, _join(h, p), px=self._ttl_ms)
        return pipe.execute(raise_on_error=False)

    def _set_within_quota(self, ledger: TenantLedger, values: list[tuple[str, bytes, memoryview]]) -> list[Any]:
        """One quota transaction per value (:meth:`~.quota.TenantLedger.put_commands`),
        all in one pipeline; per value, a :class:`~.quota.PutOutcome` or the error
        reply as an exception. The chunks deleted to make room are reported as
        evictions."""
        cmds = [ledger.put_commands(name.encode(), h, p) for name, h, p in values]
        replies = pipelined(self._single_pool, cmds, PUT_REPLIES)
        outcomes = [read_put_reply(replies[i : i + PUT_REPLIES]) for i in range(0, len(replies), PUT_REPLIES)]
        return [r if isinstance(r, BaseException) else self._settled(r) for r in outcomes]

    def _set_within_cluster_quota(self, ledger: ClusterLedger, values: list[tuple[str, bytes, memoryview]]) -> list[Any]:
        """The cluster's rounds (:mod:`.cluster_quota`): reserve; ``DEL`` what the
        ledger took and ``SET`` what it granted, in one pipeline; report both with the
        next reservation; at most :data:`~.cluster_quota.ROUNDS` reservations, then a
        last step confirms. Per value: the ``SET``'s reply, its error,
        :data:`QUOTA_SKIPPED` (refused, or still waiting) or :data:`QUOTA_IN_FLIGHT`.
        A ``DEL`` that failed is not reported: the chunk stays counted, and its
        deletion lapses to a later writer."""
        client = self._conn()
        names = [name.encode() for name, _, _ in values]
        out: list[Any] = [QUOTA_SKIPPED] * len(values)
        batch = cluster_quota.Batch()
        waiting = list(range(len(values)))
        for _ in range(cluster_quota.ROUNDS):
            if not waiting:
                break
            step = ledger.step(client, batch, [(names[i], len(values[i][1]) + values[i][2].nbytes) for i in waiting])
            granted, asked, waiting = [], waiting, []
            for i, answer in zip(asked, step.answers):
                if answer == cluster_quota.GRANTED:
                    granted.append(i)
                elif answer == cluster_quota.WAIT:
                    waiting.append(i)
                elif answer == cluster_quota.IN_FLIGHT:
                    out[i] = QUOTA_IN_FLIGHT
            pipe = client.pipeline(transaction=False)
            for name, _ in step.victims:
                pipe.delete(name)
            for i in granted:
                pipe.set(names[i], _join(values[i][1], values[i][2]), px=self._ttl_ms)
            self._add(pipelines=1)
            replies = pipe.execute(raise_on_error=False)
            evicted = []
            for (name, size), reply in zip(step.victims, replies):
                if not isinstance(reply, BaseException):
                    batch.forget.append((name, size))
                    if reply:
                        evicted.append(name)
            self._settled(PutOutcome(step.used, tuple(evicted)))  # the usage, the chunks deleted
            for i, reply in zip(granted, replies[len(step.victims) :]):
                out[i] = reply
                if not isinstance(reply, BaseException):
                    batch.confirm.append(names[i])
                elif isinstance(reply, redis.ResponseError):  # refused: not stored (a timeout may have been)
                    batch.failed.append(names[i])
        if batch.forget or batch.confirm or batch.failed:
            self._record_usage(ledger.step(client, batch, []).used)
        return out

    def _record_usage(self, used: int) -> None:
        with self._lock:
            self._stats.bytes_used = used

    def _settled(self, outcome: PutOutcome) -> PutOutcome:
        """Record one put's outcome: the tenant's usage, its evicted chunks."""
        with self._lock:
            self._stats.bytes_used = outcome.used
            self._stats.add(evictions=len(outcome.evicted), quota_evictions=len(outcome.evicted))
        for name in outcome.evicted:
            key = self._chunk_of(name)
            if key is not None:
                self.evicted(key)
        return outcome

    def _over_quota(self, key: ChunkKey, nbytes: int) -> None:
        self._add(skipped=1, quota_refused=1)
        if self._log_due("quota"):
            log.warning(
                "redis tier: chunk %s is a %d-byte frame, over tenant %s's tenant_quota (%d) on its own; not stored "
                "(logged once a minute, counted in extra['quota_refused']). Raise tenant_quota or use a smaller chunk_size",
                key.to_str(),
                nbytes,
                self.ledger.tenant if self.ledger is not None else "?",
                self.cfg.tenant_quota,
            )

    def _too_large(self, key: ChunkKey, nbytes: int) -> None:
        self._add(skipped=1, too_large=1)
        log.warning(
            "redis tier: chunk %s is a %d-byte frame, over max_value_size (%d); not stored. Raise max_value_size "
            "(and the server's proto-max-bulk-len if above 512MiB) or use a smaller chunk_size",
            key.to_str(),
            nbytes,
            self.cfg.max_value_size,
        )

    def _put_refused(self, key: ChunkKey, err: BaseException) -> None:
        kind = classify(err)
        if kind is Failure.FULL:
            self._add(skipped=1, oom=1)
            if self._log_due("oom"):
                log.warning(
                    "redis tier: %s is out of memory (%s); puts are skipped. Set maxmemory-policy allkeys-lru "
                    "(or volatile-lru with ttl_s) so the server evicts old chunks, or raise maxmemory",
                    self.target,
                    describe(err),
                )
            return
        self._add(skipped=1)
        self._failed("put", err)

    def remove(self, key: ChunkKey) -> bool:
        if not self._open():
            raise BackendError(f"redis remove {self._name(key)}: {self.target} is unavailable")
        try:
            with self._deadline():
                if isinstance(self.ledger, TenantLedger):  # the chunk and its entry in the tenant's ledger
                    n = self._forget([self._name(key).encode()], [self.ledger.base.encode()])
                else:
                    n = self._conn().delete(self._name(key))
                    if self.ledger is not None:  # a cluster's: its entry, in the ledger's slot, after the DEL
                        self.ledger.forget_names(self._conn(), [self._name(key).encode()])
        except Exception as err:
            self._failed("remove", err)
            raise BackendError(f"redis remove {self._name(key)}: {describe(err)}") from None
        self.mark_available()
        return bool(n)

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """SCAN (every primary of a cluster) for this tier's names under each of
        ``match``'s prefixes and DEL the chunk keys found, in pipelines of
        :data:`ERASE_BATCH` (with the entries of every tenant ledger under the prefix
        that lists them, :mod:`.quota`); each SCAN step and each pipeline runs under
        ``call_timeout_s``. Any failure raises (down, denied, a timeout)."""
        if self._closed:
            raise BackendError(f"redis erase on {self.target}: the tier is closed")
        n = 0
        try:
            bases = [] if dry_run else self._ledger_bases()
            for prefix in match.name_prefixes():
                n = self._erase_under(prefix, match, bases, n, progress, dry_run)
        except BackendError:
            raise
        except Exception as err:
            self._failed("erase", err)  # raises unless the server is away
            raise BackendError(f"redis erase on {self.target}: {describe(err)}") from None
        self.mark_available()
        return n

    def _erase_under(
        self,
        prefix: str,
        match: EraseMatch,
        bases: list[bytes],
        n: int,
        progress: Callable[[int], None] | None,
        dry_run: bool,
    ) -> int:
        """:meth:`erase` for the names under ``{prefix}{prefix of chunk keys}``;
        returns ``n`` plus how many it deleted (or, ``dry_run``, found)."""
        batch: list[bytes] = []
        names = self._scan(_glob_escape(self.cfg.prefix + prefix) + "*")
        for raw in itertools.chain(names, [None]):
            if raw is not None:
                key = self._chunk_of(raw)
                if key is not None and match(key):
                    batch.append(raw)
            if batch and (raw is None or len(batch) >= ERASE_BATCH):
                n += len(batch) if dry_run else self._delete_names(batch, bases)
                batch = []
                if progress is not None:
                    progress(n)
        return n

    def _scan(self, pattern: str) -> Iterator[bytes]:
        """The names matching ``pattern`` (SCAN, on every primary of a cluster), each
        step under ``call_timeout_s``."""
        with self._deadline():
            it = iter(self._conn().scan_iter(match=pattern, count=ERASE_BATCH))
        while True:
            with self._deadline():
                name = next(it, None)
            if name is None:
                return
            yield name if isinstance(name, bytes) else str(name).encode()

    def _chunk_of(self, name: bytes) -> ChunkKey | None:
        """The chunk key a name under this tier's prefix stands for, or None."""
        head = self.cfg.prefix.encode()
        if not name.startswith(head):
            return None
        try:
            return ChunkKey.parse(name[len(head) :].decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return None

    def _ledger_bases(self) -> list[bytes]:
        """The base name of every tenant ledger under this prefix (at most
        :data:`MAX_LEDGERS`), whatever this config's own quota: other engines' quotas
        count the chunks an erase deletes (on a cluster, SCAN of every primary)."""
        names = self._scan(ledger_pattern(_glob_escape(self.cfg.prefix)))
        return [raw[: -len(b"sizes")] for raw in itertools.islice(names, MAX_LEDGERS)]

    def _forget(self, names: list[bytes], bases: list[bytes]) -> int:
        """DEL ``names`` and drop their entries from the ledgers ``bases`` in one
        script (:data:`~.quota.FORGET_SCRIPT`; redis-py loads it again after a
        ``NOSCRIPT``); how many of the names existed."""
        return int(self._conn().register_script(FORGET_SCRIPT)(keys=names, args=bases))

    def record_namespace(self, namespace: bytes, record: bytes) -> None:
        """SET ``<prefix>lmcache-ns-<id>`` (no expiry; a ``maxmemory`` policy that
        evicts any key may still drop it), under ``call_timeout_s``; raises on failure."""
        if self._closed:
            raise BackendError(f"redis record on {self.target}: the tier is closed")
        try:
            with self._deadline():
                self._conn().set(self.cfg.prefix + RECORD_NAME + namespace.hex(), record)
        except Exception as err:
            raise BackendError(f"redis record on {self.target}: {describe(err)}") from None

    def namespace_records(self) -> dict[bytes, bytes]:
        """SCAN (every primary of a cluster) for ``<prefix>lmcache-ns-*`` and GET each
        record, under ``call_timeout_s`` a step; a value over 4 KiB is skipped."""
        if self._closed:
            raise BackendError(f"redis records on {self.target}: the tier is closed")
        head = (self.cfg.prefix + RECORD_NAME).encode()
        out: dict[bytes, bytes] = {}
        try:
            for raw in self._scan(_glob_escape(self.cfg.prefix + RECORD_NAME) + "*"):
                if len(out) >= MAX_RECORDS:
                    break
                ns = namespace_of(raw[len(head) :].decode("ascii", "replace")) if raw.startswith(head) else None
                if ns is None:
                    continue
                with self._deadline():
                    value = self._conn().getrange(raw, 0, MAX_RECORD_BYTES)
                if value is not None and len(value) <= MAX_RECORD_BYTES:
                    out[ns] = bytes(value)
        except Exception as err:
            raise BackendError(f"redis records on {self.target}: {describe(err)}") from None
        return out

    def _delete_names(self, names: list[bytes], bases: list[bytes]) -> int:
        """DEL each name (one key per command: a cluster's keys live in many slots),
        with its entries in the tenant ledgers ``bases`` when there are any; how many
        existed."""
        with self._deadline():
            if bases and self._single_pool is not None:
                self._add(pipelines=1)
                return self._forget(names, bases)
            pipe = self._pipeline()
            for name in names:
                pipe.delete(name)
            n = sum(int(r) for r in pipe.execute())
        for base in bases:  # a cluster's ledgers: each in its own slot, after the DELs
            with self._deadline():
                cluster_quota.forget_in(self._conn(), base.decode(), names)
        return n

    # -- housekeeping ---------------------------------------------------------------
    def ping(self) -> None:
        """One PING (to every node of a cluster); raises redis-py's error as it comes."""
        with self._deadline():
            self._conn().ping()

    def quota_usage(self) -> int | None:
        """The tenant's bytes on the server now, as its ledger counts them (all of its
        engines together), under ``call_timeout_s``; None without ``tenant_quota``.
        ``stats().bytes_used`` keeps the figure from this engine's last put between calls."""
        if self.ledger is None:
            return None
        with self._deadline():
            used = int(self._conn().get(self.ledger.base + "bytes") or 0)
        self._record_usage(used)
        return used

    def stats(self) -> BackendStats:
        with self._lock:
            s = self._stats.snapshot()
        s.extra.update(
            server_down=self._gate.down,
            server_trips=self._gate.trips,
            target=self.target,
            prefix=self.cfg.prefix,
        )
        if self.watcher is not None:
            s.extra["key_events"] = self.watcher.state
            s.extra["key_event_reconnects"] = self.watcher.reconnects
            s.extra["key_event_pauses"] = self.watcher.pauses
            s.extra["key_event_cpu_s"] = round(self.watcher.cpu_s, 3)
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.watcher is not None:
            self.watcher.close()
        if self.client is None:
            return
        try:
            self.client.close()
        except Exception as err:  # a dead socket: nothing left to release
            log.debug("redis tier: client close: %s", describe(err))
