"""Eviction policies: which resident chunk a byte-budgeted tier drops next.

A policy only orders keys; the tier owns the data, the byte budget and the pins. It
is a reusable component: any tier with an in-memory index (the CPU tier today, the
disk tier's index later) drives one through the same calls:

- ``insert(key, size)`` after storing a new key, ``hit(key)`` on a read that found
  it, ``remove(key)`` when the tier drops it for another reason (``remove()``,
  corruption, close);
- when the tier needs room: ``admit(key, size)`` first (an admission filter may say
  "keep what you have, do not store this one"), then ``pop_victim()`` until enough
  bytes are free. ``pop_victim`` detaches the key from the policy; the tier then
  evicts it, or, if it is pinned (an in-flight load), hands it back with
  ``keep(key, size)``: pins win over every policy. A tier asks for at most as many
  victims as it holds keys per eviction, so a fully pinned tier stops;
- optional hints, ignored by default: ``chain(keys)``, one request's prompt chunks
  head first (the engine's lookup: a chunk is worthless without the ones before it),
  and ``partial(key)`` after storing a partial chunk (only an identical prompt can hit
  it). The CPU tier passes both on (``StorageBackend.hint_chain`` / ``hint_partial``).

Policies here (selected per tier with ``eviction:`` in YAML; plugins add more through
the ``register_eviction_policies`` hook):

- ``lru``: least recently used first. Flushed by a scan or a cyclic access pattern
  larger than the tier (each item is evicted just before it comes back).
- ``s3fifo``: S3-FIFO (Yang et al., "FIFO queues are all you need for cache
  eviction", SOSP 2023): a small FIFO for newcomers, a main FIFO with reinsertion for
  items seen again, a ghost list of recently evicted newcomers that go straight to
  main when they return. Resists one-off scans; a round-robin cycle larger than the
  tier still misses every time, like LRU (the main FIFO is cycled through).
- ``tinylfu``: W-TinyLFU (Einziger, Friedman, Manes, "TinyLFU: A highly efficient
  cache admission policy", ACM Transactions on Storage 2017): a 1% LRU window for
  newcomers, an SLRU main area (probation + 80% protected), and an admission duel
  (frequency of the window's evictee against the main area's victim) on access
  counts that are halved every ``10 x`` resident-keys accesses. A cycle larger than
  the tier keeps the part that fits from its second pass on; a scan never displaces
  a hot set.
- ``adaptive`` (the default): prefix-aware, in one of two orders. A prompt leaves the
  tier from its tail (its chunks are queued again tail first when it is served) and a
  partial chunk goes first; the order is a segmented LRU (recency: every stored chunk
  gets its turn, 30% protected for chunks read again) or W-TinyLFU as above
  (frequency: a scan or a cycle larger than the tier keeps what it holds), whichever
  of two miniature shadow tiers (sampled keys, Waldspurger et al., ATC 2017) served
  more hits lately. It starts in frequency order when nothing told them apart before
  the tier filled (a first pass over documents keeps the first ones whole) and goes
  to recency when stored chunks come back within the tier's reach (conversations).
  See :class:`AdaptivePolicy` and docs/eviction.md for measurements.
"""

from __future__ import annotations

import abc
import math
from collections import OrderedDict, deque
from typing import Callable, ClassVar, Hashable, Protocol, Sequence

Key = Hashable


_MIX = 0x9E3779B1  # Fibonacci hashing: the low 32 bits of hash x this are uniform


def _sample_point(key: Key) -> int:
    """Where the shadows place a key in ``[0, 2**32)`` (sampled below a threshold):
    its chunk hash's hash for a chunk key (a namespace shared by every key adds
    nothing), the key's own otherwise, mixed by Fibonacci hashing. The low 32 bits of
    a product depend only on the low 32 bits of its factors, so the hash is cut to
    them first: the product then stays a machine-size integer."""
    part = getattr(key, "chunk_hash", None)
    return (hash(key if part is None else part) & 0xFFFFFFFF) * _MIX & 0xFFFFFFFF


class EvictionPolicy(abc.ABC):
    """The order in which a tier evicts (see the module docstring for the calls).

    Not thread-safe: the tier calls it under the lock that guards its index."""

    name: ClassVar[str] = "unnamed"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))

    @abc.abstractmethod
    def insert(self, key: Key, size: int) -> None:
        """``key`` (``size`` bytes) was stored; it is not resident yet."""

    @abc.abstractmethod
    def hit(self, key: Key) -> None:
        """A read found resident ``key``."""

    @abc.abstractmethod
    def remove(self, key: Key) -> None:
        """Resident ``key`` left the tier other than through :meth:`pop_victim`."""

    @abc.abstractmethod
    def pop_victim(self) -> Key | None:
        """Detach and return the next key to evict; ``None`` when none is resident."""

    @abc.abstractmethod
    def keep(self, key: Key, size: int) -> None:
        """A key from :meth:`pop_victim` could not be evicted (pinned): resident again."""

    def admit(self, key: Key, size: int) -> bool:
        """The tier is full: store ``key`` (evicting others) or not. Default: yes."""
        return True

    def miss(self, key: Key) -> None:
        """A read did not find ``key`` (frequency-based policies count it)."""

    # -- optional hints (a tier that has them passes them on; defaults: ignored) --------
    def chain(self, keys: Sequence[Key]) -> None:
        """Hint: ``keys`` are one request's prompt chunks, head first. Each key's chunk
        extends the previous one's prefix, so the request can use ``keys[i]`` only
        together with all of ``keys[:i]``: a chunk is worthless once the one before it is
        gone. The tier passes it on at lookup, before the request's reads (:meth:`hit`)
        and stores (:meth:`insert`) of these keys; any of them may be resident or not.
        The policy may keep a reference to ``keys`` (the caller does not change it)."""

    def partial(self, key: Key) -> None:
        """Hint: resident ``key``, just inserted, holds a partial chunk (a prompt's last,
        shorter than the chunk size): only a prompt with exactly its tokens can hit it,
        so it is worth less than a whole chunk."""

    def __len__(self) -> int:  # resident keys the policy tracks
        return 0


PolicyFactory = Callable[[int], EvictionPolicy]


class PolicyRegistry(Protocol):
    """What a tier needs to build its eviction policy by name (the engine's plugin
    manager, ``BackendContext.plugins``): a new policy for ``capacity`` bytes, an
    unknown name a ``ConfigError`` naming ``key_path`` and ``source``."""

    def create_eviction_policy(self, name: str, capacity: int, *, key_path: str, source: str) -> EvictionPolicy: ...


class LruPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, int] = OrderedDict()

    def insert(self, key: Key, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def hit(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Key | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def keep(self, key: Key, size: int) -> None:
        self._order[key] = size

    def __len__(self) -> int:
        return len(self._order)


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO with byte sizes: small queue 10% of the capacity, frequencies capped
    at 3, a ghost list holding as many keys as the tier holds."""

    name = "s3fifo"
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # OrderedDicts as FIFOs: first item = oldest (the tail the paper evicts from)
        self._small: OrderedDict[Key, int] = OrderedDict()
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._size: dict[Key, int] = {}
        self._freq: dict[Key, int] = {}
        self._small_bytes = 0

    def insert(self, key: Key, size: int) -> None:
        self._size[key] = size
        self._freq[key] = 0
        if self._ghost.pop(key, "absent") is None:
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size

    def hit(self, key: Key) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: Key) -> None:
        if self._small.pop(key, None) is not None:
            self._small_bytes -= self._size[key]
        self._main.pop(key, None)
        self._size.pop(key, None)
        self._freq.pop(key, None)

    def _detach(self, key: Key) -> Key:
        self._size.pop(key, None)
        self._freq.pop(key, None)
        return key

    def pop_victim(self) -> Key | None:
        # Each pass either evicts or lowers a frequency / moves a key from small to
        # main (at most once per key), so the loop ends.
        for _ in range(4 * (len(self._size) + 1)):
            if not self._size:
                return None
            if self._small and (self._small_bytes > self.SMALL_FRACTION * self.capacity or not self._main):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._freq[key] > 0:  # seen again while in small: promote to main
                    self._freq[key] = 0
                    self._main[key] = size
                    continue
                self._ghost[key] = None
                while len(self._ghost) > max(16, len(self._size)):
                    self._ghost.popitem(last=False)
                return self._detach(key)
            key, size = self._main.popitem(last=False)
            if self._freq[key] > 0:  # reinsertion: a second chance per access
                self._freq[key] -= 1
                self._main[key] = size
                continue
            return self._detach(key)
        # unreachable in practice; evict the oldest main key rather than loop
        if self._main:
            return self._detach(self._main.popitem(last=False)[0])
        return None

    def keep(self, key: Key, size: int) -> None:
        self._size[key] = size
        self._freq[key] = 1
        self._main[key] = size

    def __len__(self) -> int:
        return len(self._size)


class TinyLfuPolicy(EvictionPolicy):
    """W-TinyLFU with byte sizes. Access counts are kept exactly per key (a chunk is
    kilobytes to megabytes, so a counter per recently seen key is negligible where
    the paper uses a sketch), with the paper's reset: every ``10 x`` resident keys
    (at least 1000) recorded accesses, every count is halved and zeros dropped,
    which also bounds the table.

    Memory per resident key is one slot in one table, ``_meta``, plus a pointer in
    its segment's queue. The table's value packs the segment (bits 0-1: 0 = not
    resident, else :data:`WINDOW` / :data:`PROBATION` / :data:`PROTECTED`), the count
    (bits 2-5) and the key's size as a code into a table of the sizes seen (bits 6
    up; code 0: the size is in ``_odd``, for when more than :data:`SIZE_CODES`
    distinct sizes appear). With the few distinct chunk sizes a tier has, values stay
    below 257: CPython's shared small ints, no object per key.

    Each segment is an LRU order kept as a queue of keys with lazy deletion: a key
    touched or moved is appended again and its older place becomes *stale*, counted
    per segment in ``_stale`` (only keys that have stale places are in it). The
    stale places of a key always precede its live one, so the front of a queue is
    live exactly when its key has no stale count there. A queue is rebuilt when it
    holds more than twice its live keys (amortized O(1) per operation). Decisions are
    those of ordered dicts moved to the end on access (tests/core/test_eviction.py
    checks them against a plain-list model)."""

    name = "tinylfu"
    WINDOW_FRACTION = 0.01
    PROTECTED_FRACTION = 0.8
    MAX_COUNT = 15
    WINDOW, PROBATION, PROTECTED = 1, 2, 3
    SIZE_CODES = 1024

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # indexed by segment number (0 unused); queue front = least recent
        self._q: tuple[deque[Key], ...] = (deque(), deque(), deque(), deque())
        self._stale: tuple[dict[Key, int], ...] = ({}, {}, {}, {})
        self._n = [0, 0, 0, 0]  # live keys per segment
        self._bytes = [0, 0, 0, 0]
        self._meta: dict[Key, int] = {}
        self._sizes: list[int] = [0]  # size code -> size (code 0: see _odd)
        self._codes: dict[int, int] = {}  # size -> code
        self._odd: dict[Key, int] = {}  # sizes of resident keys with code 0
        self._samples = 0
        self.window_budget = self.WINDOW_FRACTION * self.capacity
        self.main_budget = self.capacity - self.window_budget

    # -- frequency -------------------------------------------------------------------
    def _bump(self, key: Key) -> int:
        """``key``'s meta value with one more access counted (count capped at
        :data:`MAX_COUNT`). The caller stores it (with any segment change), so a hot
        path writes the table once; when this access triggers the periodic halving,
        the value returned is the halved one (0 if the halving dropped the key)."""
        v = self._meta.get(key, 0)
        if v & 60 != 60:
            v += 4
        self._samples += 1
        n = self._n
        if self._samples >= 1000 and self._samples >= 10 * (n[1] + n[2] + n[3]):
            self._samples = 0
            meta = self._meta
            meta[key] = v
            # halve every count; drop keys left with neither a count nor a segment
            self._meta = {k: (c & ~60) | ((c & 60) >> 3 << 2) for k, c in meta.items() if c & 3 or c > 7}
            v = self._meta.get(key, 0)
        return v

    def frequency(self, key: Key) -> int:
        return self._meta.get(key, 0) >> 2 & 15

    # -- segments --------------------------------------------------------------------
    def _code(self, key: Key, size: int) -> int:
        """The meta bits for ``size`` (bits 6 up), recording an odd size aside."""
        c = self._codes.get(size)
        if c is None:
            if len(self._sizes) > self.SIZE_CODES:
                self._odd[key] = size
                return 0
            c = self._codes[size] = len(self._sizes)
            self._sizes.append(size)
        return c << 6

    def _size(self, key: Key, v: int) -> int:
        return self._sizes[v >> 6] if v >> 6 else self._odd[key]

    def _push(self, seg: int, key: Key) -> None:
        q = self._q[seg]
        q.append(key)
        if len(q) > 2 * self._n[seg] + 64:  # rebuild without the stale places
            self._q = self._q[:seg] + (deque(self._live(seg)),) + self._q[seg + 1 :]
            self._stale[seg].clear()

    def _live(self, seg: int) -> list[Key]:
        """The live keys of ``seg``, least recent first (a key's stale places come
        before its live one)."""
        st = dict(self._stale[seg])
        live = []
        for k in self._q[seg]:
            c = st.get(k)
            if c is None:
                live.append(k)
            elif c > 1:
                st[k] = c - 1
            else:
                del st[k]
        return live

    def _front(self, seg: int) -> Key | None:
        """The least recent live key of ``seg`` (stale places before it dropped)."""
        q, st = self._q[seg], self._stale[seg]
        while q:
            k = q[0]
            c = st.get(k)
            if c is None:
                return k
            q.popleft()
            if c > 1:
                st[k] = c - 1
            else:
                del st[k]
        return None

    def _add(self, seg: int, key: Key, size: int) -> None:
        meta = self._meta
        meta[key] = self._code(key, size) | (meta.get(key, 0) & 60) | seg
        self._n[seg] += 1
        self._bytes[seg] += size
        self._push(seg, key)

    def _take(self, key: Key, v: int, front: bool = False) -> int:
        """Detach resident ``key`` (meta value ``v``) from its segment; its size.
        ``front``: it is its queue's live front (popped instead of marked stale)."""
        seg = v & 3
        size = self._size(key, v)
        if front:
            self._q[seg].popleft()
        else:
            st = self._stale[seg]
            st[key] = st.get(key, 0) + 1
        self._n[seg] -= 1
        self._bytes[seg] -= size
        if not v >> 6:
            del self._odd[key]
        if v & 60:
            self._meta[key] = v & 60
        else:
            del self._meta[key]
        return size

    def insert(self, key: Key, size: int) -> None:
        v = self._bump(key)
        if v & 3:  # stored again while resident: it starts over in the window
            self._take(key, v)
            v &= 60
        meta, b, n = self._meta, self._bytes, self._n
        meta[key] = self._code(key, size) | v | 1
        n[1] += 1
        b[1] += size
        self._push(1, key)
        # while the tier is not full, window overflow simply moves to probation
        while b[1] > self.window_budget and n[1] > 1:
            old = self._front(1)
            ov = meta[old]
            osize = self._size(old, ov)
            if b[2] + b[3] + osize > self.main_budget:
                break
            self._q[1].popleft()
            n[1] -= 1
            b[1] -= osize
            n[2] += 1
            b[2] += osize
            self._push(2, old)
            meta[old] = ov ^ 3  # window (1) -> probation (2)

    def _touch(self, seg: int, key: Key) -> None:
        st = self._stale[seg]
        st[key] = st.get(key, 0) + 1
        self._push(seg, key)

    def hit(self, key: Key) -> None:
        v = self._bump(key)
        meta = self._meta
        seg = v & 3
        if seg == 1 or seg == 3:
            meta[key] = v
            self._touch(seg, key)
        elif seg == 2:  # seen again in probation: promoted to protected
            b, n = self._bytes, self._n
            size = self._size(key, v)
            st = self._stale[2]
            st[key] = st.get(key, 0) + 1
            n[2] -= 1
            b[2] -= size
            n[3] += 1
            b[3] += size
            self._push(3, key)
            meta[key] = v | 3
            limit = self.PROTECTED_FRACTION * self.main_budget
            while b[3] > limit and n[3] > 1:
                old = self._front(3)
                self._q[3].popleft()
                ov = meta[old]
                osize = self._size(old, ov)
                n[3] -= 1
                b[3] -= osize
                n[2] += 1
                b[2] += osize
                self._push(2, old)
                meta[old] = ov ^ 1  # protected (3) -> probation (2)
        elif v:
            meta[key] = v

    def miss(self, key: Key) -> None:
        v = self._bump(key)
        if v:
            self._meta[key] = v

    def remove(self, key: Key) -> None:
        v = self._meta.get(key, 0)
        if v & 3:
            self._take(key, v)

    def _main_victim(self) -> Key | None:
        for seg in (2, 3):
            k = self._front(seg)
            if k is not None:
                return k
        return None

    def pop_victim(self) -> Key | None:
        meta = self._meta
        if self._n[1] and self._bytes[1] > self.window_budget:
            cand = self._front(1)
            victim = self._main_victim()
            if victim is None:
                self._take(cand, meta[cand], front=True)
                return cand
            if self.frequency(cand) > self.frequency(victim):
                # the newcomer earned its place: it enters probation, the victim leaves
                vv = meta[victim]
                size = self._take(cand, meta[cand], front=True)
                self._add(2, cand, size)
                self._take(victim, vv, front=True)
                return victim
            self._take(cand, meta[cand], front=True)
            return cand
        victim = self._main_victim()
        if victim is None and self._n[1]:
            victim = self._front(1)
        if victim is None:
            return None
        self._take(victim, meta[victim], front=True)
        return victim

    def keep(self, key: Key, size: int) -> None:
        if not self._meta.get(key, 0) & 3:
            self._add(2, key, size)

    def __len__(self) -> int:
        n = self._n
        return n[1] + n[2] + n[3]


#: the two orders :class:`_Segments` runs in (see :class:`AdaptivePolicy`)
RECENCY, FREQUENCY = "recency", "frequency"


class _Rec:
    """A resident key's record in :class:`_Segments` (in ``info`` and as its value in
    its segment): the segment, the size, the access count, whether the key is sampled
    for the shadows, whether an open chain ends with it."""

    __slots__ = ("seg", "size", "count", "sampled", "ends")

    def __init__(self, seg: OrderedDict[Key, _Rec], size: int, count: int, sampled: bool) -> None:
        self.seg = seg
        self.size = size
        self.count = count
        self.sampled = sampled
        self.ends = False


class _Segments:
    """The order behind :class:`AdaptivePolicy` and its shadow caches: a window for
    newcomers, a probation LRU and a protected LRU (keys hit since they came in), each
    an ordered dict (first item = least recent), in one of two modes:

    - :data:`RECENCY`: segmented LRU. A newcomer enters probation; a hit there promotes
      it to protected, which keeps at most :data:`PROTECTED_RECENCY` of the bytes (its
      least recent go back to probation); the victim is probation's least recent. No
      admission test: a stored chunk stays until it is the oldest.
    - :data:`FREQUENCY`: W-TinyLFU as in :class:`TinyLfuPolicy` (a window of
      :data:`WINDOW` of the bytes, protected :data:`PROTECTED_FREQUENCY` of the main
      area): the window's oldest duels probation's victim on access counts and a tie
      keeps the resident, so a cycle or scan larger than the tier keeps what it holds.

    In both, the prefix structure orders the chunks: when a request's chain
    (:meth:`chain`) has been served (its last chunk stored or read), its resident
    chunks are queued again tail first, so its deepest chunk is the least recent and a
    prompt is evicted from its end, never from its head (a head-first touch, as plain
    LRU does it, leaves the head the least recent and evicts it first, which orphans
    the rest). Protected is trimmed back to its share only then (or at the next
    victim), so a prompt read head first is demoted tail first too. A partial chunk
    (:meth:`partial`) goes to the front of its queue: it is the next victim. Two
    exceptions, bounded by the window (1% of the bytes): in frequency mode, a full
    tier's chunks still in the window when their chain is served join probation, if
    admitted, behind the chain's head; at a switch to recency the window's chunks join
    probation as its newest.

    ``info`` maps a resident key to its record (:class:`_Rec`, also its value in its
    segment) and a key that left to its access count; counts are halved every 10 x
    resident-keys accesses (TinyLFU's reset), which drops the keys that left with a
    count of one. An access hashes its key two to four times."""

    WINDOW = 0.01
    PROTECTED_FREQUENCY = 0.8
    PROTECTED_RECENCY = 0.3
    MAX_COUNT = 15
    #: requests whose chain waits for its last key (beyond: the oldest is applied as is)
    OPEN_CHAINS = 64
    #: set by :class:`AdaptivePolicy`: a key whose :func:`_sample_point` is below it
    #: when it is stored is sampled; its accesses also go to :meth:`observe` (0: none)
    threshold = 0

    def __init__(self, capacity: int, mode: str, share: float | None = None) -> None:
        self.capacity = max(0, int(capacity))
        self.mode = mode
        #: protected's share of the bytes (at most), and that share in bytes
        self.share = self._share(mode, share)
        self.tlimit = self.share * self.capacity
        #: the window's bytes (frequency mode), and the main area's (the rest)
        self.wlimit = self.WINDOW * self.capacity
        self.mlimit = self.capacity - self.wlimit
        self.window: OrderedDict[Key, _Rec] = OrderedDict()
        self.probation: OrderedDict[Key, _Rec] = OrderedDict()
        self.protected: OrderedDict[Key, _Rec] = OrderedDict()
        self.info: dict[Key, _Rec | int] = {}
        self.resident = 0
        self.wbytes = self.pbytes = self.tbytes = 0
        self.samples = 0
        self.halve_at = 1000
        #: whether a victim has been asked for (the tier has been full)
        self.evicting = False
        # open chains: id -> keys, and their last key -> id (the access that closes it)
        self.chains: OrderedDict[int, Sequence[Key]] = OrderedDict()
        self.chain_end: dict[Key, int] = {}
        self.next_chain = 0

    def observe(self, key: Key, size: int, hit: bool) -> None:
        """A sampled access (see ``threshold``), a hit or a store."""

    def applied(self, keys: list[Key]) -> None:
        """The sampled keys of a chain just applied (:meth:`apply`), head first."""

    def count(self, key: Key) -> int:
        v = self.info.get(key, 0)
        return v.count if isinstance(v, _Rec) else v

    def halve(self) -> None:
        """TinyLFU's reset: every count halved; keys that left with nothing dropped."""
        self.samples = 0
        info: dict[Key, _Rec | int] = {}
        for k, v in self.info.items():
            if isinstance(v, _Rec):
                v.count >>= 1
                info[k] = v
            elif v > 1:
                info[k] = v >> 1
        self.info = info
        self.halve_at = max(1000, 10 * self.resident)

    def miss(self, key: Key) -> None:
        v = self.info.get(key, 0)
        if not isinstance(v, _Rec):
            self.info[key] = v + 1 if v < self.MAX_COUNT else v
            self.samples += 1
            if self.samples >= self.halve_at:
                self.halve()

    def _share(self, mode: str, share: float | None) -> float:
        if share is not None:
            return share
        return self.PROTECTED_FREQUENCY * (1 - self.WINDOW) if mode is FREQUENCY else self.PROTECTED_RECENCY

    def set_mode(self, mode: str, share: float | None = None) -> None:
        self.share = self._share(mode, share)
        self.tlimit = self.share * self.capacity
        if mode is not self.mode:
            self.mode = mode
            if mode is RECENCY:  # no window in recency mode: its keys join probation
                probation = self.probation
                for k, rec in self.window.items():
                    probation[k] = rec
                    rec.seg = probation
                self.pbytes += self.wbytes
                self.window.clear()
                self.wbytes = 0
        self._trim()

    def _trim(self) -> None:
        """Protected back within its share: its least recent go to probation."""
        protected, limit = self.protected, self.tlimit
        while self.tbytes > limit and len(protected) > 1:
            old, orec = next(iter(protected.items()))
            self._move(old, orec, self.probation)

    def _move(self, key: Key, rec: _Rec, seg: OrderedDict[Key, _Rec]) -> None:
        """Resident ``key`` to the end of ``seg``, from the segment it is in."""
        old = rec.seg
        del old[key]
        size = rec.size
        if old is self.probation:
            self.pbytes -= size
        elif old is self.protected:
            self.tbytes -= size
        else:
            self.wbytes -= size
        seg[key] = rec
        rec.seg = seg
        if seg is self.probation:
            self.pbytes += size
        elif seg is self.protected:
            self.tbytes += size
        else:
            self.wbytes += size

    # insert, hit and pop are the per-access path
    def insert(self, key: Key, size: int) -> None:
        info = self.info
        v = info.get(key, 0)
        if isinstance(v, _Rec):  # stored again while resident: it starts over
            self.detach(key)
            v = v.count
        t = self.threshold
        sampled = t > 0 and _sample_point(key) < t
        if sampled:
            self.observe(key, size, False)
        if self.mode is RECENCY:
            seg = self.probation
            self.pbytes += size
        else:
            seg = self.window
            self.wbytes += size
        rec = _Rec(seg, size, v + 1 if v < self.MAX_COUNT else v, sampled)
        info[key] = rec
        seg[key] = rec
        self.resident += 1
        self.samples += 1
        if self.samples >= self.halve_at:
            self.halve()
        if seg is self.window and not self.evicting:
            budget = self.wlimit
            if self.wbytes > budget and len(seg) > 1:
                # while the tier fills (no victim asked for yet), window overflow moves on
                # to probation; after that it is the next victim's duel that admits it (a
                # tier makes room before it stores, so the main area always has room for
                # one more just then: moving it here would admit every newcomer)
                main = self.mlimit
                while self.wbytes > budget and len(seg) > 1:
                    old, orec = next(iter(seg.items()))
                    if self.pbytes + self.tbytes + orec.size > main:
                        break
                    self._move(old, orec, self.probation)
        if self.chain_end and key in self.chain_end:
            self.close(key)

    def hit(self, key: Key) -> None:
        rec = self.info.get(key)
        if not isinstance(rec, _Rec):
            return
        if rec.sampled:
            self.observe(key, rec.size, True)
        if rec.count < self.MAX_COUNT:
            rec.count += 1
        self.samples += 1
        if self.samples >= self.halve_at:
            self.halve()
        seg = rec.seg
        if seg is self.probation:
            # seen again in probation: promoted. Protected is trimmed back to its share
            # when the chain is applied or at the next victim, not here: a prompt is read
            # head first, so trimming now would demote its head first.
            self._move(key, rec, self.protected)
        else:
            seg.move_to_end(key)
        if rec.ends:
            rec.ends = False
            self.close(key)

    def pop(self) -> tuple[Key, int] | None:
        """Detach the next victim: ``(key, size)``, or None when nothing is resident."""
        self.evicting = True
        if self.tbytes > self.tlimit:
            self._trim()
        window = self.window
        if window and self.wbytes > self.wlimit and self.mode is FREQUENCY:
            cand, crec = window.popitem(last=False)
            main = self.probation or self.protected
            if not main or crec.count <= next(iter(main.values())).count:
                # a tie keeps the resident: the newcomer leaves
                return cand, self._left(cand, crec, window)
            # the newcomer earned its place: it enters probation, the victim leaves
            window[cand] = crec  # (back where _move takes it from)
            self._move(cand, crec, self.probation)
        seg = self.probation or self.protected or window
        if not seg:
            return None
        key, rec = seg.popitem(last=False)
        return key, self._left(key, rec, seg)

    def detach(self, key: Key) -> int:
        """Drop resident ``key`` (its count stays); its size, 0 if it was not resident."""
        rec = self.info.get(key)
        if not isinstance(rec, _Rec):
            return 0
        seg = rec.seg
        del seg[key]
        return self._left(key, rec, seg)

    def _left(self, key: Key, rec: _Rec, seg: OrderedDict[Key, _Rec]) -> int:
        """``key`` (record ``rec``) was taken out of ``seg``: the byte counts follow, its
        count stays; its size."""
        size: int = rec.size
        if seg is self.probation:
            self.pbytes -= size
        elif seg is self.protected:
            self.tbytes -= size
        else:
            self.wbytes -= size
        self.resident -= 1
        if rec.count:
            self.info[key] = rec.count
        else:
            del self.info[key]
        return size

    def keep(self, key: Key, size: int) -> None:
        v = self.info.get(key, 0)
        if not isinstance(v, _Rec):
            rec = _Rec(self.probation, size, v, False)
            self.info[key] = rec
            self.probation[key] = rec
            self.pbytes += size
            self.resident += 1

    # -- prefix structure ------------------------------------------------------------
    def chain(self, keys: Sequence[Key]) -> None:
        if not keys:
            return
        cid = self.next_chain
        self.next_chain += 1
        end = keys[-1]
        old = self.chain_end.get(end)
        if old is not None:  # the same prompt again before its stores ended: one chain
            self.chains.pop(old, None)
        self.chains[cid] = keys
        self.chain_end[end] = cid
        rec = self.info.get(end)
        if isinstance(rec, _Rec):  # resident already: a hit on it closes the chain
            rec.ends = True
        if len(self.chains) > self.OPEN_CHAINS:
            oid, okeys = self.chains.popitem(last=False)
            if self.chain_end.get(okeys[-1]) == oid:
                del self.chain_end[okeys[-1]]
            self.apply(okeys)

    def close(self, end: Key) -> None:
        cid = self.chain_end.pop(end, None)
        keys = self.chains.pop(cid, None) if cid is not None else None
        if keys is not None:
            self.apply(keys)

    def apply(self, keys: Sequence[Key]) -> None:
        """Queue the chain's resident prefix again, tail first (the head most recent).
        Its chunks still in the window (the last ones stored) join probation here while
        the tier fills; once it has been full they wait for their admission duel and, if
        they win it, join probation behind the chain's head."""
        info = self.info
        recs = []
        for k in keys:
            rec = info.get(k)
            if not isinstance(rec, _Rec):
                break  # a gap: what follows can not be hit until it is filled
            recs.append(rec)
        sampled = []
        window, probation = self.window, self.probation
        filling = not self.evicting
        main = self.mlimit
        for i in range(len(recs) - 1, -1, -1):
            rec = recs[i]
            if filling and rec.seg is window and self.pbytes + self.tbytes + rec.size <= main:
                self._move(keys[i], rec, probation)
            else:
                rec.seg.move_to_end(keys[i])
            if rec.sampled:
                sampled.append(keys[i])
        if self.tbytes > self.tlimit:
            self._trim()
        if sampled:
            sampled.reverse()
            self.applied(sampled)

    def partial(self, key: Key) -> None:
        rec = self.info.get(key)
        if isinstance(rec, _Rec) and rec.seg is not self.protected:
            rec.seg.move_to_end(key, last=False)
            if rec.sampled:
                self.applied_partial(key)

    def applied_partial(self, key: Key) -> None:
        """A sampled key just marked partial (:meth:`partial`)."""


class _Shadow:
    """A miniature tier: a :class:`_Segments` in a fixed mode over the sampled keys,
    with its own byte budget."""

    __slots__ = ("seg", "budget", "used")

    def __init__(self, budget: int, mode: str, share: float | None) -> None:
        self.seg = _Segments(budget, mode, share)
        self.budget = budget
        self.used = 0

    def access(self, key: Key, size: int) -> int:
        """A read of ``key`` that stores it on a miss, as the engine does; 1 on a hit."""
        seg = self.seg
        if isinstance(seg.info.get(key), _Rec):
            seg.hit(key)
            return 1
        if size > self.budget:
            return 0
        while self.used + size > self.budget:
            victim = seg.pop()
            if victim is None:
                break
            self.used -= victim[1]
        seg.insert(key, size)
        self.used += size
        return 0


class AdaptivePolicy(_Segments, EvictionPolicy):
    """Prefix-aware and adaptive: the order of :class:`_Segments` (chains evicted from
    the tail, partial chunks first), in recency or frequency mode, whichever of two
    shadow caches served more hits lately.

    The shadows are miniature tiers (Waldspurger et al., "Cache Modeling and
    Optimization using Miniature Simulations", USENIX ATC 2017): the keys whose hash
    falls below a threshold, about :data:`SAMPLE` chunks' worth, with the budget scaled
    by the same rate (whole chunks of the first size stored); one per entry of
    :data:`CONFIGS` (frequency, recency), all fed the tier's sampled reads and stores
    and the chain order of its requests. The tier switches to another order when that
    order's shadow leads the current one's by more than :data:`Z` standard deviations
    plus :data:`MARGIN` hits (counting the accesses where exactly one of the two hit,
    decayed with a half-life of :data:`HALF_LIFE` x the shadows' chunks: old evidence
    fades, a phase is followed).

    Until the tier is first full the two modes cannot differ at its size; a second pair
    of shadows at :data:`PRIOR_SCALE` of it fills earlier and picks the starting mode:
    frequency when they found no difference at all (nothing read twice yet, e.g. a
    first pass over documents: keep the first ones whole rather than cycle through
    them) or when frequency did significantly better; recency otherwise. They are
    dropped when the tier fills."""

    name = "adaptive"
    #: the orders the shadows compare: (mode, protected share; None: the mode's default)
    CONFIGS: ClassVar[tuple[tuple[str, float | None], ...]] = ((FREQUENCY, None), (RECENCY, None))
    SAMPLE = 4096
    HALF_LIFE = 4.0
    Z = 3.0
    MARGIN = 4.0
    PRIOR_SCALE = 0.5

    def __init__(self, capacity: int) -> None:
        _Segments.__init__(self, capacity, FREQUENCY)
        self.threshold = 1 << 32  # every key, until the first insert sets the sampling rate
        self._main: list[_Shadow] = []  # one per config, the tier's size (scaled)
        self._prior: list[_Shadow] = []  # one per config, PRIOR_SCALE of that, until the tier fills
        n = len(self.CONFIGS)
        # per pair i < j of shadows: hits of j minus hits of i, and the accesses where they
        # differ, decayed (each new access weighs 1/decay more; divided when read)
        self._lead = [[0.0] * n for _ in range(n)]
        self._spread = [[0.0] * n for _ in range(n)]
        self._weight = 1.0
        self._grow = 1.0
        # the same for the half-size shadows, not decayed
        self._prior_lead = [[0.0] * n for _ in range(n)]
        self._prior_spread = [[0.0] * n for _ in range(n)]
        #: the index in CONFIGS of the order in use
        self.config = 0
        #: whether the tier has been full (the starting order is chosen then)
        self.full = False
        #: order switches so far
        self.switches = 0

    def _start(self, size: int) -> None:
        """Size the shadows from the first chunk stored (a tier's chunks are alike)."""
        size = max(1, size)
        rate = min(1.0, self.SAMPLE * size / max(1, self.capacity))
        self.threshold = max(1, int(rate * (1 << 32)))
        chunks = int(rate * self.capacity / size)  # whole chunks of this size in the shadows
        self._main = [_Shadow(chunks * size, mode, share) for mode, share in self.CONFIGS]
        self._prior = [_Shadow(int(chunks * self.PRIOR_SCALE) * size, mode, share) for mode, share in self.CONFIGS]
        self._grow = 2.0 ** (1.0 / max(1.0, self.HALF_LIFE * chunks))

    @staticmethod
    def _tally(shadows: list[_Shadow], key: Key, size: int, lead: list[list[float]], spread: list[list[float]], w: float) -> bool:
        """Feed one access to ``shadows`` and add, per pair, the difference of their
        outcomes with weight ``w``; whether any differed."""
        hits = [s.access(key, size) for s in shadows]
        if min(hits) == max(hits):
            return False
        for i in range(len(hits)):
            for j in range(i + 1, len(hits)):
                d = hits[j] - hits[i]
                if d:
                    lead[i][j] += d * w
                    spread[i][j] += w
        return True

    def _better(self, lead: list[list[float]], spread: list[list[float]], c: int, scale: float) -> int:
        """The config whose shadow leads config ``c``'s by more than :data:`Z` standard
        deviations plus :data:`MARGIN` hits (the largest such lead), else ``c``."""
        best, best_lead = c, 0.0
        for j in range(len(self.CONFIGS)):
            if j == c:
                continue
            i, k, sign = (c, j, 1.0) if c < j else (j, c, -1.0)
            d = sign * lead[i][k] * scale
            if d > self.Z * math.sqrt(spread[i][k] * scale) + self.MARGIN and d > best_lead:
                best, best_lead = j, d
        return best

    def observe(self, key: Key, size: int, hit: bool) -> None:
        """One sampled access, fed to the shadows; switch order on a clear lead."""
        if not self._main:  # the first insert: size the shadows, then sample as they say
            self._start(size)
            if _sample_point(key) >= self.threshold:
                return
        w = self._weight = self._weight * self._grow
        if self._tally(self._main, key, size, self._lead, self._spread, w) and self.full:
            best = self._better(self._lead, self._spread, self.config, 1.0 / w)
            if best != self.config:
                self._use(best)
                self.switches += 1
        if w > 1e100:  # renormalize (the ratios are what matter)
            for rows in (self._lead, self._spread):
                for row in rows:
                    row[:] = [x / w for x in row]
            self._weight = 1.0
        if self._prior:
            self._tally(self._prior, key, size, self._prior_lead, self._prior_spread, 1.0)

    def _use(self, i: int) -> None:
        self.config = i
        mode, share = self.CONFIGS[i]
        self.set_mode(mode, share)

    def _fill(self) -> None:
        """The tier is full for the first time: the starting order (see the class doc):
        the first config (frequency) when its half-size shadow and the second's saw no
        difference, else the second unless another one did significantly better."""
        self.full = True
        if len(self.CONFIGS) < 2 or self._prior_spread[0][1] < self.MARGIN:
            start = 0
        else:
            start = self._better(self._prior_lead, self._prior_spread, 1, 1.0)
        self._use(start)
        self._prior = []
        n = len(self.CONFIGS)
        self._lead = [[0.0] * n for _ in range(n)]
        self._spread = [[0.0] * n for _ in range(n)]
        self._weight = 1.0

    def _shadows(self) -> list[_Shadow]:
        return self._main + self._prior

    def applied(self, keys: list[Key]) -> None:
        for shadow in self._shadows():
            shadow.seg.apply(keys)

    def applied_partial(self, key: Key) -> None:
        for shadow in self._shadows():
            shadow.seg.partial(key)

    # -- the policy contract (insert, hit, chain and partial: _Segments') ------------
    def remove(self, key: Key) -> None:
        self.detach(key)

    def pop_victim(self) -> Key | None:
        if not self.full:
            self._fill()
        victim = self.pop()
        return None if victim is None else victim[0]

    # _Segments' own (first in the MRO already; named here as the contract's, without
    # a wrapper's extra call on the per-access path)
    keep = _Segments.keep
    miss = _Segments.miss
    chain = _Segments.chain
    partial = _Segments.partial

    def frequency(self, key: Key) -> int:
        return self.count(key)

    def __len__(self) -> int:
        return self.resident


BUILTIN_POLICIES: dict[str, tuple[PolicyFactory, str]] = {
    "lru": (LruPolicy, "least recently used first"),
    "s3fifo": (S3FifoPolicy, "S3-FIFO, Yang et al., SOSP 2023: scan-resistant FIFO queues"),
    "tinylfu": (TinyLfuPolicy, "W-TinyLFU, Einziger et al., ACM ToS 2017: frequency admission, loop- and scan-resistant"),
    "adaptive": (
        AdaptivePolicy,
        "prefix-aware; segmented LRU or W-TinyLFU, whichever of two sampled shadow caches hits more",
    ),
}
