"""The Mooncake tier: chunks as serde frames, one Mooncake object each.

Contract (see :class:`lmcache_core.backend.StorageBackend`):

* Batched: ``contains`` is one ``batch_is_exist`` for all keys; :meth:`get_batch`
  and :meth:`put_batch` move many chunks in one ``batch_get_into`` /
  ``batch_put_from_multi_buffers`` call (``get``/``put`` are batches of one).
* Zero-copy puts: the frame header comes from registered staging memory and the
  payload straight from the caller's tensor (the engine's pool, registered with the
  store at startup). Gets land in registered staging memory, are verified there
  (checksum, key, dtype, shape), and only then copied into ``out``: a transfer that
  overran its deadline may still be writing, and must never write into a pool
  buffer the engine has already reused (see :mod:`.staging`).
* Failure rule: every call has a deadline (:mod:`.guard`); a dead master, an
  overrun or a busy client is a miss, and closes the health gate so the following
  calls are misses without touching the client until the cooldown passes. A
  segment owner that is down fails the transfers of its objects (misses, counted).
  A put the store rejects for space is a skipped put, counted in ``no_space``.
* With ``tenant_quota`` the client is set up as the engine's tenant label (its
  Mooncake ``tenant_id``): the master keeps the tenant's objects in their own
  namespace and bounds their bytes by the tenant's quota in its policy (:mod:`.quota`).
  Puts it refuses for the quota count in ``quota_refused`` (and ``no_space``); the
  tenant's usage, as the master counts it, is ``bytes_used`` / ``bytes_capacity``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Sequence, TypeVar

import numpy as np
import torch

from lmcache_core.backend import BATCHED, SHARED, BackendError, BackendStats, EraseMatch, EraseUnsupported, StorageBackend
from lmcache_core.keys import ChunkKey
from lmcache_core.memory import MemoryBuffer
from lmcache_core.frames import Codec, FrameReader, Verdict

from . import codes
from .client import SetupFailed, StoreClient
from .config import MooncakeConfig
from .frames import frame_parts, max_frame_len
from lmcache_core.health import HealthGate

from .guard import Deadline, Pending, StoreUnavailable
from .quota import QuotaUnknown, TenantQuota, tenant_quota
from .staging import Staging

log = logging.getLogger(__name__)

Region = tuple[int, int]  # (base address, bytes)
DEADLINE_BYTES_PER_S = 256 << 20  # a call's deadline grows by 1 s per 256 MiB it moves
ERASE_IDS_PER_CALL = 64  # namespaces in one remove_by_regex pattern
PIPELINE_BYTES = 32 << 20  # batches move in store calls of about this many bytes, one at a time
USAGE_REFRESH_S = 5.0  # stats() reads the tenant's usage from the master's metrics at most this often (in the background)
USAGE_TIMEOUT_S = 2.0  # deadline of one read of the master's metrics
WARN_EVERY_S = 60.0  # a put refused for an unknown tenant is logged at most this often
T = TypeVar("T")


def _groups(things: list[T], nbytes: Callable[[T], int]) -> list[list[T]]:
    """``things`` in order, cut into groups of about :data:`PIPELINE_BYTES` (at least one each)."""
    groups: list[list[T]] = []
    size = 0
    for t in things:
        if not groups or size >= PIPELINE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes(t)
    return groups


class MooncakeBackend(StorageBackend):
    name = "mooncake"
    capabilities = frozenset({SHARED, BATCHED})

    def __init__(
        self,
        cfg: MooncakeConfig,
        *,
        codec: Codec,
        codecs: Mapping[str, Codec],
        pool_region: Region | None = None,
        region_owner: object | None = None,
        client_factory: Callable[[MooncakeConfig], StoreClient] | None = None,
        tenant: str | None = None,
    ) -> None:
        """``tenant``: the engine's tenant label; with ``tenant_quota`` it is the
        client's Mooncake tenant (and is then required)."""
        if cfg.tenant_quota and tenant is None:
            raise ValueError("tenant_quota needs the engine's tenant label (the top-level tenant key)")
        self.cfg = cfg
        self.tenant = tenant if cfg.tenant_quota else None
        self.codec = codec
        self.codecs = dict(codecs)
        # Background writers get half the workers, so lookups and loads always find one free.
        self.write_concurrency = max(1, cfg.max_inflight // 2)
        self.timeout_s = cfg.timeout_s
        self._client_factory = client_factory or (lambda c: StoreClient(c, tenant=self.tenant))
        self._gate = HealthGate(cfg.down_cooldown_s)
        self._deadline = Deadline(cfg.max_inflight, self._gate)
        self._staging = Staging(cfg.staging_size, cfg.quarantine_s)
        self._regions: list[Region] = [(self._staging.base, self._staging.size)]
        if pool_region is not None:
            self._regions.append(pool_region)
        # What owns the pool's memory (the engine's MemoryPool): held for as long as a
        # client may have that memory registered. Without it a tier outliving its
        # context registered freed memory, and a client's own buffer allocated at that
        # address failed setup with "does not support overlapped memory region".
        self._region_owner = region_owner
        self._client: StoreClient | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reconnector: threading.Thread | None = None
        self._stats = BackendStats(
            self.name,
            extra=dict(
                no_space=0,
                corrupt=0,
                transfer_errors=0,
                overruns=0,
                zero_copy_puts=0,
                copied_puts=0,
                setup_failures=0,
            ),
        )
        self._usage_read_at = 0.0  # monotonic time of the last read of the tenant's usage (tenant_quota)
        self._usage_reader: threading.Thread | None = None
        self._unknown_tenant_warned_at = -WARN_EVERY_S
        if self.tenant is not None:
            self._stats.extra.update(quota_tenant=self.tenant, quota_refused=0, tenant_not_registered=0)

    def __repr__(self) -> str:
        c = self.cfg
        tenant = "" if self.tenant is None else f", tenant={self.tenant!r}"
        return f"MooncakeBackend(master={c.master!r}, metadata={c.metadata!r}, protocol={c.protocol!r}{tenant})"

    # -- connection -----------------------------------------------------------------
    def connect(self) -> None:
        """Set up a client (within ``setup_timeout_s``) and register staging and the
        pool with it. Raises :class:`BackendError` saying what failed and where."""
        client = self._client_factory(self.cfg)
        where = f"master {self.cfg.master} (metadata {self.cfg.metadata}, protocol {self.cfg.protocol})"
        try:
            self._deadline.run("setup", self.cfg.setup_timeout_s, client.setup)
            for base, size in self._regions:
                client.register(base, size)
        except (SetupFailed, StoreUnavailable) as err:
            self._count(setup_failures=1)
            self._gate.failed()
            if not (isinstance(err, StoreUnavailable) and err.overrun):
                client.close()  # an overrun setup is abandoned: the native call may still be running
            raise BackendError(
                f"mooncake tier: cannot connect to {where}: {err}. Check that mooncake_master runs there with "
                "--enable_http_metadata_server (or that the metadata server is up), and that this host can reach it"
            ) from None
        with self._lock:
            closed = self._closed.is_set()
            if not closed:
                self._client = client
        if closed:  # close() ran while we were connecting
            client.close()
            return
        if self._gate.succeeded():
            log.info("mooncake tier: connected to %s", where)

    def connect_in_background(self) -> None:
        """Keep trying :meth:`connect` every cooldown until it works or the tier closes;
        calls are misses meanwhile."""
        self._gate.failed()

        def loop() -> None:
            while not self._closed.wait(max(0.2, self._gate.cooldown_s)):
                try:
                    self.connect()
                    return
                except BackendError as err:
                    log.debug("%s", err)
                except Exception as err:  # a native error must not end the retries
                    self._gate.failed()
                    log.warning("mooncake tier: connecting to master %s failed: %s: %s", self.cfg.master, type(err).__name__, err)

        self._reconnector = threading.Thread(target=loop, name="lmcache-mooncake-connect", daemon=True)
        self._reconnector.start()

    # -- bookkeeping ----------------------------------------------------------------
    def _count(self, **counts: int) -> None:
        with self._lock:
            self._stats.add(**counts)

    def _name(self, key: ChunkKey) -> str:
        return self.cfg.key_prefix + key.to_str()

    def _ready(self) -> StoreClient | None:
        with self._lock:
            return None if self._closed.is_set() else self._client

    def _start(
        self, op: str, fn: Callable[[], list[int]], on_late: Callable[[], None] | None = None, nbytes: int = 0
    ) -> Pending[list[int]] | None:
        """Start ``fn`` on a worker under its deadline (``timeout_s`` plus ``nbytes`` at
        :data:`DEADLINE_BYTES_PER_S`, so a large batch is not cut off for being large);
        None when it cannot start (gate closed, workers busy): it never reached the client."""
        try:
            return self._deadline.start(op, self.timeout_s + nbytes / DEADLINE_BYTES_PER_S, fn, on_late=on_late)
        except StoreUnavailable:
            return None

    def _finish(self, op: str, pending: Pending[list[int]] | None) -> tuple[list[int] | None, str]:
        """``(codes, state)``. ``codes`` is None unless the client answered; ``state`` is
        ``"ok"``, ``"never"`` (did not start), ``"overrun"`` (still running: its
        ``on_late`` releases its memory later) or ``"raised"`` (the binding raised).
        On an answer the gate follows the codes."""
        if pending is None:
            return None, "never"
        try:
            result = pending.wait()
        except StoreUnavailable as err:
            self._count(overruns=1, errors=1)
            self._down(op, str(err))
            return None, "overrun"
        except Exception as err:  # the binding rejected the call: a miss, counted
            self._gate.succeeded()
            self._count(errors=1)
            log.warning("mooncake tier: %s raised %s: %s", op, type(err).__name__, err)
            return None, "raised"
        if any(codes.outcome(c) is codes.Outcome.MASTER_DOWN for c in result):
            self._count(errors=1)
            self._down(op, f"master did not answer (code {min(result)})")
        elif self._gate.succeeded():
            log.warning("mooncake tier: master %s answers again; calls go through", self.cfg.master)
        return result, "ok"

    def _call(
        self, op: str, fn: Callable[[], list[int]], on_late: Callable[[], None] | None = None, nbytes: int = 0
    ) -> tuple[list[int] | None, str]:
        return self._finish(op, self._start(op, fn, on_late, nbytes))

    def _unanswered(self, slots: Sequence[MemoryBuffer], result: list[int] | None, state: str) -> None:
        """Staging memory of a call without a usable answer: free if the call never ran,
        left to ``on_late`` after an overrun, quarantined otherwise."""
        if state == "never":
            for s in slots:
                s.release()
        elif state != "overrun":
            if result is not None:
                self._count(errors=1)  # an answer that does not fit the question
            self._staging.quarantine(list(slots))

    def _down(self, op: str, why: str) -> None:
        if self._gate.failed():
            log.warning(
                "mooncake tier: %s against master %s failed (%s); every call is a miss for the next %.1fs, then retried",
                op,
                self.cfg.master,
                why,
                self._gate.cooldown_s,
            )

    def _registered(self, t: torch.Tensor) -> bool:
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        return any(base <= ptr and ptr + n <= base + size for base, size in self._regions)

    def _settle(self, slots: Sequence[MemoryBuffer | None], code: int) -> None:
        """Release staging slots, or quarantine them when I/O may still touch them."""
        live = [s for s in slots if s is not None]
        if codes.memory_reusable(code):
            for s in live:
                s.release()
        else:
            self._staging.quarantine(live)

    # -- lookups --------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        client = self._ready()
        if client is None or not keys:
            return 0
        names = [self._name(k) for k in keys]
        result, _ = self._call("lookup", lambda: client.exist(names))
        if result is None:
            return 0
        if len(result) != len(keys):
            self._count(errors=1)
            return 0
        n = 0
        for c in result:
            if c != 1:
                break
            n += 1
        return n

    # -- reads ----------------------------------------------------------------------
    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        return self.get_many([key], [out])[0]

    def get_batch(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Deprecated name of :meth:`get_many`."""
        return self.get_many(keys, outs)

    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Fill each ``outs[i]`` with chunk ``keys[i]``; per-key hit flags. The chunks go
        in ``batch_get_into`` calls of about :data:`PIPELINE_BYTES`, one at a time;
        verifying one group overlaps the transfer of the next."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output tensors")
        hits = [False] * len(keys)
        client = self._ready()
        if client is None:
            self._count(misses=len(keys))
            return hits
        caps = [max_frame_len(k, out, FrameReader(self.codecs).seal) for k, out in zip(keys, outs)]
        groups = _groups(list(range(len(keys))), lambda i: caps[i])
        Launched = tuple[Pending[list[int]] | None, list[tuple[int, MemoryBuffer]]]

        def launch(group: list[int]) -> Launched:
            """Staging for one group is taken only now, so the memory a batch cycles
            through stays about two groups (warm in cache) however large the batch."""
            taken: list[tuple[int, MemoryBuffer]] = []
            for i in group:
                slot = self._staging.allocate(caps[i])
                if slot is None:
                    self._count(misses=1)
                else:
                    taken.append((i, slot))
            if not taken:
                return None, taken
            names = [self._name(keys[i]) for i, _ in taken]
            ptrs = [s.tensor.data_ptr() for _, s in taken]
            sizes = [caps[i] for i, _ in taken]
            slots = [s for _, s in taken]
            pending = self._start(
                "get",
                lambda: client.get_into(names, ptrs, sizes),
                on_late=lambda: self._staging.quarantine(slots),
                nbytes=sum(sizes),
            )
            return pending, taken

        current = launch(groups[0]) if groups else (None, [])
        for j in range(len(groups)):
            pending, taken = current
            result, state = self._finish("get", pending) if taken else (None, "never")
            # the next group's transfer runs while this group is verified and copied
            current = launch(groups[j + 1]) if j + 1 < len(groups) else (None, [])
            if not taken:
                continue
            if result is None or len(result) != len(taken):
                self._count(misses=len(taken))
                self._unanswered([s for _, s in taken], result, state)
                continue
            for (i, slot), code in zip(taken, result):
                if code > 0:
                    hits[i] = self._decode(keys[i], slot, code, outs[i])
                    slot.release()
                    continue
                self._settle([slot], code)
                kind = codes.outcome(code)
                self._count(misses=1)
                if kind is codes.Outcome.TRANSFER:
                    self._count(transfer_errors=1, errors=1)
                elif kind is codes.Outcome.OTHER:
                    self._count(errors=1)
        return hits

    def _decode(self, key: ChunkKey, slot: MemoryBuffer, n: int, out: torch.Tensor) -> bool:
        frame = slot.tensor.numpy().data.cast("B")[:n]
        decoded = FrameReader(self.codecs).decode(frame, key=key, out=out)
        if decoded.verdict is not Verdict.OK:
            self._count(misses=1)
            if decoded.verdict is not Verdict.WRONG_SHAPE:  # another shape may be fine; the rest is not ours
                self._count(corrupt=1)
                log.warning(
                    "mooncake tier: object %s is not a valid frame for its key (%s); treated as a miss",
                    self._name(key),
                    decoded.reason,
                )
            return False
        self._count(hits=1, get_bytes=out.numel() * out.element_size())
        return True

    # -- writes ---------------------------------------------------------------------
    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        return self.put_many([(key, data)])[0]

    def put_batch(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[bool]:
        """Deprecated name of :meth:`put_many`."""
        return self.put_many(items)

    def put_many(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[bool]:
        """Store each ``(key, tensor)``; per-item success flags. Existing keys are
        successes (no-op); a put rejected for space is skipped. The chunks go in
        ``batch_put_from_multi_buffers`` calls of about :data:`PIPELINE_BYTES`: framing
        (checksums) of one group overlaps the transfer of the previous one."""
        done = [False] * len(items)
        client = self._ready()
        if client is None:
            self._count(skipped=len(items))
            return done
        Prepared = list[tuple[int, list[MemoryBuffer], list[int], list[int]]]

        def prepare(group: list[int]) -> Prepared:
            todo: Prepared = []
            for i in group:
                key, data = items[i]
                header, payload, in_place = frame_parts(key, data, self.codec)
                hslot = self._staging.allocate(len(header))
                if hslot is None:
                    self._count(skipped=1)
                    continue
                hslot.tensor.numpy()[:] = np.frombuffer(header, dtype=np.uint8)
                slots = [hslot]
                if in_place and (self.cfg.protocol == "tcp" or self._registered(data)):
                    pptr = data.data_ptr()
                    self._count(zero_copy_puts=1)
                else:
                    pslot = self._staging.allocate(payload.nbytes)
                    if pslot is None:
                        hslot.release()
                        self._count(skipped=1)
                        continue
                    pslot.tensor.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
                    slots.append(pslot)
                    pptr = pslot.tensor.data_ptr()
                    self._count(copied_puts=1)
                todo.append((i, slots, [hslot.tensor.data_ptr(), pptr], [len(header), payload.nbytes]))
            return todo

        def launch(todo: Prepared) -> Pending[list[int]] | None:
            if not todo:
                return None
            names = [self._name(items[i][0]) for i, _, _, _ in todo]
            ptrs = [p for _, _, p, _ in todo]
            sizes = [n for _, _, _, n in todo]
            all_slots = [s for _, slots, _, _ in todo for s in slots]
            keep_alive = [items[i][1] for i, _, _, _ in todo]  # the call reads these tensors until it returns

            def call() -> list[int]:
                assert keep_alive is not None
                return client.put_parts(names, ptrs, sizes)

            return self._start("put", call, on_late=lambda: self._staging.quarantine(all_slots), nbytes=sum(map(sum, sizes)))

        groups = _groups(list(range(len(items))), lambda i: items[i][1].numel() * items[i][1].element_size())
        current = prepare(groups[0]) if groups else []
        pending = launch(current)
        for j in range(len(groups)):
            # the next group is framed (checksummed) while this one transfers
            following = prepare(groups[j + 1]) if j + 1 < len(groups) else []
            if current:
                self._take_puts(items, current, *self._finish("put", pending), done)
            current, pending = following, launch(following)
        return done

    def _take_puts(
        self,
        items: Sequence[tuple[ChunkKey, torch.Tensor]],
        todo: list[tuple[int, list[MemoryBuffer], list[int], list[int]]],
        result: list[int] | None,
        state: str,
        done: list[bool],
    ) -> None:
        if result is None or len(result) != len(todo):
            self._count(skipped=len(todo))
            self._unanswered([s for _, slots, _, _ in todo for s in slots], result, state)
            return
        for (i, slots, _, _), code in zip(todo, result):
            self._settle(slots, code)
            kind = codes.outcome(code)
            if kind is codes.Outcome.OK:
                done[i] = True
                self._count(puts=1, put_bytes=items[i][1].numel() * items[i][1].element_size())
            elif kind is codes.Outcome.NO_SPACE:
                self._count(skipped=1, no_space=1)
                if code == codes.TENANT_QUOTA_EXCEEDED:
                    self._count(quota_refused=1)
            elif kind is codes.Outcome.NO_TENANT:
                self._count(skipped=1, tenant_not_registered=1)
                self._warn_unknown_tenant()
            else:
                self._count(skipped=1, errors=1)
                if kind is codes.Outcome.TRANSFER:
                    self._count(transfer_errors=1)

    def _warn_unknown_tenant(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._unknown_tenant_warned_at < WARN_EVERY_S:
                return
            self._unknown_tenant_warned_at = now
        log.warning(
            "mooncake tier: master %s refuses puts of tenant %r: its tenant quota policy has no quota for it "
            "(TENANT_NOT_REGISTERED; logged once a minute, counted in extra['tenant_not_registered']). "
            "Add the tenant to the policy file, or correct the engine's tenant label",
            self.cfg.master,
            self.tenant,
        )

    # -- the tenant's quota (tenant_quota) ------------------------------------------
    def quota_usage(self, timeout_s: float = USAGE_TIMEOUT_S) -> TenantQuota | None:
        """The tenant's quota and usage as the master counts them, read from its metrics
        server (``master_metrics``) and kept in :meth:`stats`; None without
        ``tenant_quota``. Raises :class:`QuotaUnknown` when they cannot be read, or
        when the master keeps no quota for the tenant."""
        if self.tenant is None:
            return None
        try:
            quota = tenant_quota(self.cfg.metrics_url(), self.tenant, timeout_s)
        finally:
            with self._lock:
                self._usage_read_at = time.monotonic()
        with self._lock:
            self._stats.bytes_used = quota.charged
            self._stats.bytes_capacity = quota.effective
            self._stats.extra.update(
                quota_requested=quota.requested, quota_evicted_bytes=quota.evicted, quota_refused_by_master=quota.refused
            )
        return quota

    def _refresh_usage(self) -> None:
        """Start a background read of the tenant's usage when the last one is older
        than :data:`USAGE_REFRESH_S` (``stats()`` never waits on the network)."""
        with self._lock:
            if (
                self.tenant is None
                or self._closed.is_set()
                or time.monotonic() - self._usage_read_at < USAGE_REFRESH_S
                or (self._usage_reader is not None and self._usage_reader.is_alive())
            ):
                return

            def read() -> None:
                try:
                    self.quota_usage()
                except QuotaUnknown as err:
                    log.debug("mooncake tier: tenant usage: %s", err)

            self._usage_reader = threading.Thread(target=read, name="lmcache-mooncake-usage", daemon=True)
            self._usage_reader.start()

    def remove(self, key: ChunkKey) -> bool:
        client = self._ready()
        if client is None:
            raise BackendError(f"mooncake remove {self._name(key)}: not connected to master {self.cfg.master}")
        result, _ = self._call("remove", lambda: client.remove([self._name(key)]))
        if result is None or len(result) != 1:
            raise BackendError(f"mooncake remove {self._name(key)}: master {self.cfg.master} did not answer")
        kind = codes.outcome(result[0])
        if kind is codes.Outcome.OK:
            return True
        if kind is codes.Outcome.MISSING:
            return False
        raise BackendError(f"mooncake remove {self._name(key)}: store returned code {result[0]}")

    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """Remove every object of this ``key_prefix`` whose chunk key ``match`` takes, by
        the master's ``remove_by_regex`` (:data:`ERASE_IDS_PER_CALL` namespaces a call).
        Mooncake's client lists nothing, so a dry run cannot count: EraseUnsupported.
        With ``tenant_quota`` the master removes the tenant's own objects only (each
        tenant has its own namespace), so erase with that tenant's config."""
        if dry_run:
            raise EraseUnsupported("Mooncake Store's client cannot list objects, so it cannot count without deleting")
        client = self._ready()
        if client is None:
            raise BackendError(f"mooncake erase: not connected to master {self.cfg.master}")
        prefix = self.cfg.key_prefix.replace(".", "\\.")  # the only regex character key_prefix may hold
        ids = None if match.namespaces is None else sorted(n.hex() for n in match.namespaces)
        groups = (
            ["[0-9a-f]{32}"]
            if ids is None
            else ["(" + "|".join(ids[i : i + ERASE_IDS_PER_CALL]) + ")" for i in range(0, len(ids), ERASE_IDS_PER_CALL)]
        )
        n = 0
        for group in groups:
            pattern = f"^{prefix}v1-{group}-[0-9a-f]{{32}}$"
            result, _ = self._call("erase", lambda: client.remove_matching(pattern))
            if result is None or len(result) != 1:
                raise BackendError(f"mooncake erase: master {self.cfg.master} did not answer")
            if result[0] < 0:
                raise BackendError(f"mooncake erase: master {self.cfg.master} returned code {result[0]}")
            n += result[0]
            if progress is not None:
                progress(n)
        return n

    # -- housekeeping ---------------------------------------------------------------
    def stats(self) -> BackendStats:
        self._refresh_usage()
        with self._lock:
            s = self._stats.snapshot()
            connected = self._client is not None
        s.extra.update(
            master=self.cfg.master,
            protocol=self.cfg.protocol,
            connected=connected,
            master_down=self._gate.down,
            master_trips=self._gate.trips,
            busy_rejects=self._deadline.rejected_busy,
            staging_full=self._staging.full,
            staging_used=self._staging.used,
            quarantined_bytes=self._staging.quarantined_bytes,
        )
        return s

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        self._deadline.close()
        if client is None:
            return
        if self._deadline.busy:
            # A call is still inside the native client; closing under it could crash the
            # process. The client (and its registered memory) is left to process exit.
            log.warning("mooncake tier: %d store calls still running at close; client left open", self._deadline.busy)
            self._abandoned = (client, self._staging)
            return
        try:
            client.close()
        except Exception as err:  # closing a client whose master is gone: nothing to do
            log.debug("mooncake tier: client close: %s", err)
