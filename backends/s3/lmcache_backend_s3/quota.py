"""A hard per-tenant byte quota on a shared bucket (``tenant_quota``), kept in one ledger object.

A tenant's engines all write under the tenant's own prefix, so its chunks are exactly the
``{prefix}/v1-*`` objects and deleting among them never touches another tenant. Next to
them, ``{prefix}/lmcache-quota`` (never a chunk or namespace-record name) holds the
ledger, JSON: the tenant, the quota, ``used`` bytes and the live leases
``{id: [bytes, until]}``. It is only ever replaced by a conditional PUT (``If-None-Match:
*`` to create it, ``If-Match: <etag>`` to update it; on 412 the writer reads it again).

A process takes a *lease* of bytes (``used += L``, one ledger write) and writes chunks out
of it with no further ledger request; it renews when the lease runs out or nears its end
(the unspent part goes back, the spent part stays counted), and returns the unspent part
on close. When ``used + L`` would pass the quota it *reconciles*: it lists the tenant's
chunks, deletes its own oldest, and writes ``used = listed bytes - deleted + the full
bytes of every unexpired lease`` under the etag it read before listing. The invariant,
at every instant: bytes under the prefix + unspent lease bytes <= ``used`` <= quota.

* Bytes are counted before a chunk is written, and ``used`` is lowered only by returning
  unspent bytes or by a reconcile after its deletions; a reconcile's figure counts a lease
  whose chunks may still be in flight in full, so it may overstate, never understate.
* A holder writes on a lease only while its put can land before ``until`` minus the
  clock skew (:meth:`LeaseTiming.write_window_s`); a put that timed out keeps its
  lease in the ledger until it expires. A crashed holder's lease expires and the next
  reconcile drops it (its chunks are then counted by the listing).
* ``remove``, ``erase`` and lifecycle rules delete chunks without lowering ``used``: it
  overstates until the next reconcile.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable

from lmcache_core.backend import BackendError, BackendStats
from lmcache_core.keys import ChunkKey

from .client import Failure, classify
from .config import S3Config
from .deadline import run_bounded
from .objects import PAGE, chunk_key, delete_names, get_small, list_page, precondition_failed

log = logging.getLogger(__name__)

LEDGER_NAME = "lmcache-quota"
"""The ledger is ``{prefix}/lmcache-quota``: chunk names start with ``v1-`` and namespace
records with ``lmcache-ns-``, so no listing of either ever takes it for one of theirs."""


@dataclass(frozen=True)
class LeaseTiming:
    """How long a lease lasts and how far hosts' clocks may disagree (lease ends are
    wall-clock times that other hosts compare with their own clocks). Fixed for a
    deployment; tests shorten them through :class:`~.backend.S3Backend`'s ``quota_timing``."""

    lease_s: float = 300.0
    clock_skew_s: float = 30.0

    def write_window_s(self, cfg: S3Config) -> float:
        """How long before a lease's end its holder stops writing on it: a put it starts
        may land this long after (a worker that began just before the operation deadline
        runs on to botocore's own bounds: every attempt's timeouts and up to 20s of
        backoff between attempts), seen from a host whose clock is ahead by the skew."""
        attempts = cfg.max_attempts * (cfg.connect_timeout_s + cfg.read_timeout_s) + (cfg.max_attempts - 1) * 20.0
        return cfg.op_deadline_s + attempts + self.clock_skew_s

    def lease_length_s(self, cfg: S3Config) -> float:
        """``lease_s``, or twice the write window where that is longer, so a lease is
        usable for at least half its life."""
        return max(self.lease_s, 2 * self.write_window_s(cfg))


DEFAULT_TIMING = LeaseTiming()

LEDGER_MAX = 1 << 20
"""Bytes of the ledger read at most (about 10,000 leases); a longer one does not decode."""

CAS_ATTEMPTS = 16
"""Conditional writes of the ledger tried per lease before the put is refused."""

LIST_PAGES_MAX = 100
"""A reconcile lists at most this many pages of 1,000 chunks; past them it refuses (a
partial listing would understate)."""

LEASE_FRACTION = 16
LEASE_CHUNKS = 4
"""A lease is ``max(LEASE_CHUNKS` chunks, quota / LEASE_FRACTION)``, at most the quota; a
reconcile deletes down to one ``quota / LEASE_FRACTION`` below what it grants."""


@dataclass
class Lease:
    """One lease of this process, as it knows it."""

    id: str
    bytes: int
    until: float
    spent: int = 0
    inflight: int = 0
    straggling: bool = False  # a put on it ended without an answer: it may still land

    @property
    def unspent(self) -> int:
        return max(0, self.bytes - self.spent)

    @property
    def done(self) -> bool:
        """Every put on it has landed or failed for sure: its entry may go."""
        return self.inflight == 0 and not self.straggling


@dataclass(frozen=True)
class Spend:
    """Bytes of one put, taken from ``lease`` by :meth:`TenantQuota.reserve`."""

    lease: Lease
    size: int


@dataclass
class Ledger:
    tenant: str
    quota: int
    used: int = 0
    leases: dict[str, tuple[int, float]] = field(default_factory=dict)

    def encode(self) -> bytes:
        body = {"tenant": self.tenant, "quota": self.quota, "used": self.used, "leases": self.leases}
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, where: str) -> "Ledger":
        try:
            d = json.loads(raw)
            leases = {str(k): (int(v[0]), float(v[1])) for k, v in d["leases"].items()}
            return cls(str(d["tenant"]), int(d["quota"]), int(d["used"]), leases)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise BackendError(
                f"s3 tenant quota: ledger {where} is not valid ({type(err).__name__}: {err}); puts are refused "
                "until it is fixed or deleted (it is rebuilt from a listing)"
            ) from None


@dataclass(frozen=True)
class Listed:
    key: ChunkKey
    name: str
    size: int
    modified: float


class TenantQuota:
    """The quota of ``tenant`` under ``cfg.prefix``; thread-safe. Requests run on ``ops``
    under the caller's deadline; S3 errors propagate (the tier classifies them)."""

    def __init__(
        self,
        client: Any,
        cfg: S3Config,
        tenant: str | None,
        ops: Executor,
        on_evicted: Callable[[ChunkKey], None],
        timing: LeaseTiming = DEFAULT_TIMING,
    ) -> None:
        if cfg.tenant_quota is None or tenant is None:
            raise ValueError("a tenant quota needs tenant_quota and the engine's tenant label")
        self.client, self.bucket, self.tenant, self.quota = client, cfg.bucket, tenant, cfg.tenant_quota
        self.ledger_name = cfg.object_name(LEDGER_NAME)
        self._head = cfg.object_name("")
        self._window_s, self._lease_s = timing.write_window_s(cfg), timing.lease_length_s(cfg)
        self._ops, self._on_evicted = ops, on_evicted
        self._turn = threading.Lock()  # one ledger update at a time in this process
        self._state = threading.Lock()  # the leases' counters, held briefly
        self._current: Lease | None = None
        self._retired: list[Lease] = []
        self.used = 0
        self.counts = {k: 0 for k in ("refused", "busy", "evictions", "lease_ops", "reconciles", "conflicts")}

    def __repr__(self) -> str:
        return f"TenantQuota(tenant={self.tenant!r}, quota={self.quota}, ledger={self.ledger_name!r})"

    # -- the put path ---------------------------------------------------------------
    def write(self, size: int, deadline: float, upload: Callable[[], bool]) -> bool:
        """Reserve ``size`` bytes, then ``upload()`` (True: stored; False: the object was
        already there, so the bytes are given back). False if the quota refused: a chunk
        larger than the quota, or no lease to be had."""
        spend = self.reserve(size, deadline)
        if spend is None:
            return False
        stored: bool | None = None
        try:
            stored = upload()
        finally:
            self.finish(spend, stored)
        return True

    def reserve(self, size: int, deadline: float) -> Spend | None:
        if size > self.quota:
            self._count("refused")
            return None
        if not self._turn.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._count("busy")
            return None
        try:
            lease = self._current
            if lease is None or lease.unspent < size or time.time() + self._window_s >= lease.until:
                lease = self._renew(size, deadline)
            if lease is None:
                self._count("refused")
                return None
            with self._state:
                lease.spent += size
                lease.inflight += 1
            return Spend(lease, size)
        finally:
            self._turn.release()

    def finish(self, spend: Spend, stored: bool | None) -> None:
        """After the put: stored (True), already there (False: the bytes come back) or
        unknown (None: it may still land, so its lease stays in the ledger to its end)."""
        with self._state:
            spend.lease.inflight -= 1
            if stored is False:
                spend.lease.spent -= spend.size
            elif stored is None:
                spend.lease.straggling = True

    # -- the ledger -----------------------------------------------------------------
    def _renew(self, size: int, deadline: float) -> Lease | None:
        want = min(self.quota, max(LEASE_CHUNKS * size, self.quota // LEASE_FRACTION))
        for _ in range(CAS_ATTEMPTS):
            ledger, etag = self._read(deadline)
            self._settle(ledger)
            grant = self._grant(ledger, etag is None, size, want, deadline)
            if grant == 0:
                return None
            lease = Lease(uuid.uuid4().hex, grant, time.time() + self._lease_s)
            ledger.used += grant
            ledger.leases[lease.id] = (grant, lease.until)
            if self._write(ledger, etag, deadline):
                self._committed(ledger, lease)
                return lease
            self._count("conflicts")
        return None

    def _settle(self, ledger: Ledger) -> None:
        """Into ``ledger``: the current lease shrinks to what it spent, and this process's
        leases whose puts have all ended leave it (their bytes stay in ``used``)."""
        with self._state:
            mine = self._retired + ([self._current] if self._current is not None else [])
            for lease in mine:
                if lease.id not in ledger.leases:
                    continue  # expired and dropped by a reconcile, which counted its chunks
                if lease is self._current:
                    ledger.used -= lease.unspent
                    ledger.leases[lease.id] = (lease.spent, lease.until)
                if lease.done:
                    del ledger.leases[lease.id]

    def _committed(self, ledger: Ledger, current: Lease | None) -> None:
        with self._state:
            old = self._retired + ([self._current] if self._current is not None else [])
            self._retired = [x for x in old if x.id in ledger.leases]
            if self._current is not None:
                self._current.bytes = self._current.spent  # spent out: never written on again
            self._current = current
            self.used = ledger.used
            self.counts["lease_ops"] += 1

    def _grant(self, ledger: Ledger, fresh: bool, size: int, want: int, deadline: float) -> int:
        """Bytes of the new lease (0: none to be had), after a reconcile if needed."""
        if not fresh and ledger.used + want <= self.quota:
            return want
        chunks = self._list(deadline)
        now = time.time()
        ledger.leases = {k: v for k, v in ledger.leases.items() if v[1] > now}
        floor = sum(b for b, _ in ledger.leases.values())
        base = floor + sum(c.size for c in chunks)
        grant = want if floor + want <= self.quota else size if floor + size <= self.quota else 0
        if grant == 0:
            return 0
        victims: list[Listed] = []
        left, room = base, max(floor, self.quota - grant - min(want, self.quota // LEASE_FRACTION))
        for c in chunks:
            if left <= room:
                break
            victims.append(c)
            left -= c.size
        ledger.used = base - self._delete(victims, deadline)
        self._count("reconciles")
        return grant if ledger.used + grant <= self.quota else 0

    def _read(self, deadline: float) -> tuple[Ledger, str | None]:
        try:
            reply = run_bounded(
                self._ops, deadline, "quota (read)", get_small, self.client, self.bucket, self.ledger_name, LEDGER_MAX
            )
        except Exception as err:
            if classify(err) is Failure.MISSING:
                return Ledger(self.tenant, self.quota), None
            raise
        raw, etag = reply
        ledger = Ledger.decode(raw, f"{self.ledger_name!r} in bucket {self.bucket!r}")
        if ledger.tenant != self.tenant:
            raise BackendError(
                f"s3 tenant quota: {self.ledger_name!r} in bucket {self.bucket!r} is tenant {ledger.tenant!r}'s "
                f"ledger, not {self.tenant!r}'s: each tenant needs a prefix of its own"
            )
        return ledger, etag

    def _write(self, ledger: Ledger, etag: str | None, deadline: float) -> bool:
        """One conditional PUT; False if another process changed (or removed) it first."""
        cond = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
        try:
            run_bounded(self._ops, deadline, "quota (write)", self._put, ledger.encode(), cond)
        except Exception as err:
            if precondition_failed(err) or classify(err) is Failure.MISSING:  # 404: If-Match on a deleted ledger
                return False
            raise
        return True

    def _put(self, body: bytes, cond: dict[str, str]) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.ledger_name, Body=body, **cond)

    def _list(self, deadline: float) -> list[Listed]:
        """The tenant's chunks, oldest first."""
        out: list[Listed] = []
        token: str | None = None
        for _ in range(LIST_PAGES_MAX):
            page = run_bounded(
                self._ops, deadline, "quota (list)", list_page, self.client, self.bucket, self._head + "v1-", token
            )
            for item in page.get("Contents", []):
                name = str(item["Key"])
                key = chunk_key(self._head, name)
                if key is not None:
                    out.append(Listed(key, name, int(item["Size"]), item["LastModified"].timestamp()))
            if not page.get("IsTruncated"):
                return sorted(out, key=lambda c: (c.modified, c.name))
            token = str(page["NextContinuationToken"])
        raise BackendError(
            f"s3 tenant quota: more than {LIST_PAGES_MAX * PAGE} objects under {self._head!r} in bucket "
            f"{self.bucket!r}; a reconcile cannot count them all (erase some, or use larger chunks)"
        )

    def _delete(self, victims: list[Listed], deadline: float) -> int:
        """Delete ``victims``; the bytes of those the server says it deleted."""
        freed = 0
        for i in range(0, len(victims), PAGE):
            batch = victims[i : i + PAGE]
            names = [c.name for c in batch]
            errors = run_bounded(self._ops, deadline, "quota (delete)", delete_names, self.client, self.bucket, names)
            failed = {str(e.get("Key")) for e in errors}
            for c in batch:
                if c.name not in failed:
                    freed += c.size
                    self._count("evictions")
                    self._on_evicted(c.key)
        return freed

    # -- housekeeping ---------------------------------------------------------------
    def usage(self, deadline: float) -> int:
        """The tenant's ``used`` bytes as the ledger holds them now (0 before its first lease)."""
        ledger, _ = self._read(deadline)
        with self._state:
            self.used = ledger.used
        return ledger.used

    def close(self, deadline: float) -> None:
        """Give back the unspent bytes; leases with puts that may still land stay until
        they expire. A failure is logged: the leases then expire."""
        with self._turn:
            if self._current is None and not self._retired:
                return
            try:
                for _ in range(CAS_ATTEMPTS):
                    ledger, etag = self._read(deadline)
                    self._settle(ledger)
                    if etag is None or self._write(ledger, etag, deadline):
                        self._committed(ledger, None)
                        return
            except Exception as err:
                log.warning("s3 tenant quota: returning the leases of %r failed (%s); they expire", self.tenant, err)

    def report(self, stats: BackendStats) -> None:
        """Into the tier's stats: ``bytes_used`` is the tenant's ``used`` as this process
        last read or wrote it, ``bytes_capacity`` the quota, counters as ``quota_*``."""
        with self._state:
            stats.bytes_used, stats.bytes_capacity = self.used, self.quota
            stats.extra.update({"quota_tenant": self.tenant, **{f"quota_{k}": v for k, v in self.counts.items()}})

    def _count(self, what: str) -> None:
        with self._state:
            self.counts[what] += 1
