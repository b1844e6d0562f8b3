"""The storage backend contract: everything a tier (ours or a third party's) implements.

A backend stores chunks (a key and a CPU tensor) and nothing else: no knowledge of
vLLM, tokens or tiers. Methods are synchronous and must be thread-safe; the engine
calls slower tiers from background threads so they never block vLLM's forward pass.

Failure rule: storage is a cache. A backend may raise on any failure; the engine
turns every exception from a backend into a miss (counted in its stats) and vLLM
recomputes. ``get`` must never fill ``out`` with data that does not belong to ``key``.
"""

from __future__ import annotations

import abc
import logging
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Container, Iterable, Iterator, Mapping, NamedTuple, Sequence, TypeVar

import torch

from .keys import KEY_FORMAT_VERSION, ChunkKey

if TYPE_CHECKING:
    from .config import CoreConfig
    from .eviction import PolicyRegistry
    from .memory import MemoryBuffer, MemoryPool
    from .serde import Codec, FrameSeal


# Optional capabilities a backend declares in ``capabilities`` (never probed).
ZERO_COPY = "zero_copy"  # get_buffer()/put_buffer(): chunks live in the shared memory pool (declare pool_bytes when registering)
PINNING = "pinning"  # pin()/unpin(): pinned chunks are never evicted
PERSISTENT = "persistent"  # survives restarts
SHARED = "shared"  # visible to other processes or machines
BATCHED = "batched"  # get_many()/put_many() cost about one round trip per batch, not one per chunk


log = logging.getLogger(__name__)


class StoredChunk(NamedTuple):
    """One chunk a tier lists (:meth:`StorageBackend.stored_chunks`): its key and the
    shape and dtype (``"bfloat16"``) it was stored with, read from storage (a hint,
    verified by the read)."""

    key: ChunkKey
    shape: tuple[int, ...]
    dtype: str


class BackendError(Exception):
    """A backend failed in a way its caller should treat as a miss."""


class EraseUnsupported(BackendError):
    """The tier cannot erase by match (it cannot list its chunks): what
    :meth:`StorageBackend.erase` raises unless the tier implements it."""


@dataclass(frozen=True)
class EraseMatch:
    """Which chunks :meth:`StorageBackend.erase` takes: those whose key's namespace
    id is in ``namespaces``, or every chunk key of the tier (``namespaces=None``)."""

    namespaces: frozenset[bytes] | None = None

    def __call__(self, key: ChunkKey) -> bool:
        return self.namespaces is None or key.namespace in self.namespaces

    def name_prefixes(self) -> list[str]:
        """Prefixes of the string forms (``str(key)``) of the matching keys, for tiers
        that list names by prefix (every key's form starts with one of them)."""
        if self.namespaces is None:
            return [f"v{KEY_FORMAT_VERSION}-"]
        return sorted(f"v{KEY_FORMAT_VERSION}-{ns.hex()}-" for ns in self.namespaces)


def prefix_count(keys: Sequence[ChunkKey], present: Container[ChunkKey]) -> int:
    """How many of ``keys``, from the first, are in ``present``: the usual body of
    :meth:`StorageBackend.contains` for a backend with an in-memory index (call it
    under the lock that guards ``present``)."""
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


def remove_each(
    remove: Callable[[ChunkKey], bool], keys: Iterable[ChunkKey], progress: Callable[[int], None] | None = None, every: int = 1000
) -> int:
    """Remove ``keys`` one at a time with ``remove`` (what an ``erase`` does once it has
    listed its chunks); how many were removed, told to ``progress`` every ``every``
    and at the end."""
    n = 0
    for key in keys:
        if remove(key):
            n += 1
            if progress is not None and n % every == 0:
                progress(n)
    if progress is not None and n % every:
        progress(n)
    return n


B = TypeVar("B", bound="StorageBackend")


def checked_at_start(backend: B, check: Callable[[], None]) -> B:
    """``backend`` once ``check()`` passed (a factory's start-up check: credentials, a
    reachable server); if it raises, the backend is closed and the error goes on."""
    try:
        check()
    except BaseException:
        backend.close()
        raise
    return backend


@dataclass
class BackendStats:
    name: str
    chunks: int = 0
    bytes_used: int = 0
    bytes_capacity: int | None = None
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    evictions: int = 0
    errors: int = 0
    skipped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, **counts: int) -> None:
        """Add to counters: the standard fields by name, anything else in ``extra``.
        Not locked: call it under the tier's own lock."""
        for k, v in counts.items():
            if k != "name" and k != "extra" and k in self.__dataclass_fields__:
                setattr(self, k, getattr(self, k) + v)
            else:
                self.extra[k] = self.extra.get(k, 0) + v

    def snapshot(self) -> "BackendStats":
        """A copy whose ``extra`` is its own (what ``stats()`` returns while the tier
        keeps counting). Not locked: call it under the tier's own lock."""
        return BackendStats(**{**self.__dict__, "extra": dict(self.extra)})


@dataclass
class BackendContext:
    """What a backend factory gets besides its own config section."""

    key_path: str
    source: str
    config: "CoreConfig"
    pool: "MemoryPool"
    codec: "Codec"
    codecs: Mapping[str, "Codec"]
    #: the engine's plugin manager, as far as a tier uses it (its eviction policies);
    #: ``None`` means the process-wide one
    plugins: "PolicyRegistry | None" = None
    #: False when a command opens the tier to administer it (``lmcache-core erase``),
    #: not an engine to serve from it: a tier then serves nothing (no listening socket:
    #: the engine using the same config may hold that port)
    serving: bool = True

    @property
    def seal(self) -> "FrameSeal | None":
        """The deployment's frame key (``frame_secret``), or ``None``. ``codec`` and
        ``codecs`` already carry it, so :func:`~lmcache_core.serde.encode` and
        :func:`~lmcache_core.serde.try_decode` seal and check frames by themselves;
        a tier that builds frames from serde's pieces passes ``seal=`` to them."""
        from .serde import seal_of

        return seal_of(self.codec)


class StorageBackend(abc.ABC):
    """One storage tier. See the module docstring for the contract."""

    name: str = "unnamed"
    capabilities: frozenset[str] = frozenset()
    #: How many background writes the engine may run against this tier at once
    #: (declared, not probed). Remote tiers set it to overlap round trips.
    write_concurrency: int = 1
    #: what :meth:`subscribe_evictions` was given (read by :meth:`evicted`)
    _eviction_callback: Callable[[ChunkKey], None] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "on_evicted" in cls.__dict__:  # a plugin written for the attribute (before subscribe_evictions)
            warnings.warn(
                f"{cls.__module__}.{cls.__qualname__} overrides StorageBackend.on_evicted, which is deprecated and "
                "goes in the next release: override subscribe_evictions(callback) instead (call super() first)",
                DeprecationWarning,
                stacklevel=2,
            )

    # -- evictions (KV events) ----------------------------------------------------------
    def subscribe_evictions(self, callback: Callable[[ChunkKey], None]) -> None:
        """From now on, report each key the tier drops on its own to make room (never
        for :meth:`remove`) to ``callback``, through :meth:`evicted`.

        The engine that owns the tier calls this once, when its first listener is added
        (vLLM's KV events on); until then nobody listens. The default stores
        ``callback``. A tier that learns of its evictions from elsewhere (a server's
        notifications, a poll of its nodes) overrides it to start watching here, and
        only here: call ``super().subscribe_evictions(callback)`` first, then start the
        watcher. A second call replaces the callback. It must return within a bounded
        time (a short wait for a subscription to be in place is fine)."""
        if _overrides_on_evicted(type(self)):
            # A plugin written for the attribute: its own on_evicted (a setter that
            # starts its watcher) gets the callback, as the engine used to set it.
            self.on_evicted = callback
        else:
            self._eviction_callback = callback

    @property
    def on_evicted(self) -> Callable[[ChunkKey], None] | None:
        """Deprecated (one release): the callback :meth:`subscribe_evictions` was given.
        Setting it subscribes (``None`` unsubscribes) with a ``DeprecationWarning``."""
        return self._eviction_callback

    @on_evicted.setter
    def on_evicted(self, callback: Callable[[ChunkKey], None] | None) -> None:
        warnings.warn(
            "setting StorageBackend.on_evicted is deprecated and goes in the next release: call subscribe_evictions(callback)",
            DeprecationWarning,
            stacklevel=2,
        )
        if callback is None:
            self._eviction_callback = None
        else:
            self.subscribe_evictions(callback)

    def evicted(self, key: ChunkKey) -> None:
        """Report an eviction of ``key`` to the subscriber (:meth:`subscribe_evictions`);
        never raises. It may run under the tier's lock, so subscribers must be quick."""
        cb = self.on_evicted  # a legacy plugin's own attribute, else the subscribed callback
        if cb is not None:
            try:
                cb(key)
            except Exception as err:  # a listener never breaks a tier
                log.warning("tier %s: eviction listener failed: %s: %s", self.name, type(err).__name__, err)

    @abc.abstractmethod
    def contains(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, are present (a prefix hit count).
        Batched: a remote backend must not pay one round trip per key. ``keys`` is
        a sequence (from the engine, a copy-free window of the prompt's keys):
        stop at the first miss rather than copying it."""

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        """The index of the first of ``keys`` present, each key on its own (not a
        prefix: independent objects in order of preference, e.g. the boundary objects
        of a hybrid model's hit, longest hit first); -1 when none is. Default: one
        :meth:`contains` per key until one is present; a remote backend may answer
        them in one round trip."""
        for i, key in enumerate(keys):
            if self.contains([key]):
                return i
        return -1

    @abc.abstractmethod
    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        """Store a copy of ``data`` (a contiguous CPU tensor). False if skipped
        (full, too large, read-only); storing an existing key is a no-op."""

    @abc.abstractmethod
    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Fill ``out`` (dtype and shape as stored) with the chunk. False on a miss,
        including corrupt or mismatched data; ``out`` may then hold anything."""

    # -- batches (every tier; native and declared ``BATCHED`` on remote tiers) -------
    def get_many(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Fill each ``outs[i]`` with ``keys[i]``'s chunk; per key, True for a hit and
        False for a miss, a corrupt or foreign frame or another shape (``outs[i]`` may
        then hold anything). A result for one key never depends on another key's
        outcome. This default calls :meth:`get` per key; a tier that declares
        ``BATCHED`` answers the whole batch in about one round trip (pipelined or
        parallel requests). May raise: the engine then counts the batch as missed."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output tensors")
        return [self.get(k, o) for k, o in zip(keys, outs)]

    def put_many(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[bool]:
        """Store each ``(key, data)``; per item, True if the chunk is now stored. The
        default calls :meth:`put` per item; ``BATCHED`` tiers use about one round trip."""
        return [self.put(k, d) for k, d in items]

    @abc.abstractmethod
    def remove(self, key: ChunkKey) -> bool:
        """Drop a chunk; False if it was not there."""

    @abc.abstractmethod
    def stats(self) -> BackendStats:
        """A snapshot of counters and sizes."""

    def close(self) -> None:
        """Release resources (threads, sockets, files). Idempotent."""

    # -- optional: erase by namespace (``lmcache-core erase``) ---------------------------
    def erase(self, match: EraseMatch, progress: Callable[[int], None] | None = None, *, dry_run: bool = False) -> int:
        """Delete every chunk of this tier whose key ``match`` takes (including chunks
        other processes wrote, for a shared tier); how many were deleted (with
        ``dry_run``: how many would be, deleting nothing). ``progress``,
        if given, is called now and then with the count so far. Every request stays
        bounded by the tier's own per-call timeouts. Raises (:class:`BackendError` or
        the client's error) when the tier cannot be listed or a deletion fails, never
        returning a count that hides a chunk left behind. Default: the tier cannot
        list its chunks (:class:`EraseUnsupported`)."""
        raise EraseUnsupported(f"tier {self.name} cannot list its chunks, so it cannot erase by namespace")

    # -- optional: namespace records (``lmcache-core erase --model/--tenant``) --------
    def record_namespace(self, namespace: bytes, record: bytes) -> None:
        """Keep ``record`` (at most 4 KiB of JSON: :mod:`lmcache_core.namespaces`) for
        the namespace id ``namespace``, replacing an earlier one, outside the tier's
        chunk budget and eviction; an engine calls it once at start for every tier it
        writes to. Default: the tier keeps no records (nothing happens)."""

    def namespace_records(self) -> dict[bytes, bytes]:
        """Every record kept here, by namespace id, whichever process wrote it (at most
        :data:`~lmcache_core.namespaces.MAX_RECORDS`; a name that is not a record's is
        skipped). Raises like :meth:`erase` when the tier cannot be listed. Default:
        :class:`EraseUnsupported` (the tier keeps none)."""
        raise EraseUnsupported(f"tier {self.name} keeps no namespace records")

    # -- optional: listing for a preload (lmcache_core.preload) ---------------------
    def stored_chunks(self, namespace: bytes) -> Iterator[StoredChunk] | None:
        """The chunks of key namespace ``namespace`` the tier holds, most recently used
        first, lazily (a caller that stops early costs no more listing), each with the
        shape and dtype it was stored with: what a starting engine preloads into its
        memory tier (the config's ``preload``). Default: None, the tier cannot list."""
        return None

    # -- optional: ZERO_COPY ------------------------------------------------------
    def get_buffer(self, key: ChunkKey) -> "MemoryBuffer | None":
        """The pool buffer holding ``key`` with one reference taken for the caller."""
        raise NotImplementedError

    def put_buffer(self, key: ChunkKey, buf: "MemoryBuffer") -> bool:
        """Adopt a pool buffer (takes its own reference) instead of copying."""
        raise NotImplementedError

    def evict_for(self, nbytes: int) -> int:
        """Evict unpinned chunks until ``nbytes`` could be allocated; bytes freed."""
        raise NotImplementedError

    # -- optional: PINNING --------------------------------------------------------
    def pin(self, keys: Sequence[ChunkKey]) -> None:
        raise NotImplementedError

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        raise NotImplementedError

    # -- optional: retention hints (lmcache_core.retention) ---------------------------
    def retain(self, keys: Sequence[ChunkKey], seconds: float, priority: int) -> int:
        """Keep ``keys`` ahead of unretained chunks for ``seconds`` (``priority`` 0-99
        orders retentions when they exceed the tier's share for them); how many resident
        keys are now retained. Default: the tier takes no hints (0)."""
        return 0

    # -- optional: hints for a tier's eviction order ---------------------------------
    def hint_chain(self, keys: Sequence[ChunkKey]) -> None:
        """Hint: ``keys`` are one request's prompt chunks, head first (each chunk
        extends the previous one's prefix), about to be read and stored. The engine
        calls it on every lookup of a prompt. A tier with an eviction policy passes it
        on (:meth:`~lmcache_core.eviction.EvictionPolicy.chain`). Default: ignored."""

    def hint_partial(self, key: ChunkKey) -> None:
        """Hint: ``key``, just stored, holds a partial chunk (a prompt's last, fewer
        tokens than the chunk size). Passed on like :meth:`hint_chain`
        (:meth:`~lmcache_core.eviction.EvictionPolicy.partial`). Default: ignored."""


def _overrides_on_evicted(cls: type[StorageBackend]) -> bool:
    """Whether ``cls`` or a base below :class:`StorageBackend` defines ``on_evicted``."""
    for klass in cls.__mro__:
        if "on_evicted" in klass.__dict__:
            return klass is not StorageBackend
    return False


BackendFactory = Callable[[Mapping[str, Any], BackendContext], StorageBackend]
