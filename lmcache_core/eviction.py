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
  victims as it holds keys per eviction, so a fully pinned tier stops.

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
"""

from __future__ import annotations

import abc
from collections import OrderedDict, deque
from typing import Callable, ClassVar, Hashable, Sequence

Key = Hashable


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


BUILTIN_POLICIES: dict[str, tuple[PolicyFactory, str]] = {
    "lru": (LruPolicy, "least recently used first"),
    "s3fifo": (S3FifoPolicy, "S3-FIFO, Yang et al., SOSP 2023: scan-resistant FIFO queues"),
    "tinylfu": (TinyLfuPolicy, "W-TinyLFU, Einziger et al., ACM ToS 2017: frequency admission, loop- and scan-resistant"),
}
