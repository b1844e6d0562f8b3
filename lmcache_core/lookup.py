"""Lookups across the tiers: how long a prefix of chunks some tier holds, and where.

:func:`lookup_runs` walks the keys once, whatever the tiers' interleaving: a tier is
handed a copy-free window of the keys (:class:`KeyWindow`) rather than a slice of the
rest, so a tier with an in-memory index touches only the keys it holds plus one. A
tier's first call gets all the remaining keys (one round trip when a prompt lies in one
tier); after a partial answer its window restarts at :data:`LOOKUP_WINDOW` keys and
grows fourfold while it comes back full, so a tier that checks every key it is given
(a batched remote lookup) does work in proportion to its hits plus a constant per call.

:func:`first_held` probes a set of independent keys (boundary objects, longest first)
in one pass over the tiers.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence, overload

from .keys import ChunkKey
from .tiers import Tier, TierStack

#: keys in a tier's lookup window after it answered short of its window
LOOKUP_WINDOW = 16


class KeyWindow(Sequence[ChunkKey]):
    """``keys[start:stop]`` as a read-only sequence that copies nothing: what a tier's
    ``contains`` gets from a lookup. Iterating it touches only the keys the tier
    reads, so a tier that stops at its first miss costs its hits plus one."""

    __slots__ = ("_keys", "_start", "_stop")

    def __init__(self, keys: Sequence[ChunkKey], start: int, stop: int) -> None:
        self._keys, self._start, self._stop = keys, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, i: int) -> ChunkKey: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ChunkKey]: ...

    def __getitem__(self, i: int | slice) -> ChunkKey | Sequence[ChunkKey]:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self._stop - self._start)
            if step == 1:
                return KeyWindow(self._keys, self._start + lo, self._start + max(lo, hi))
            return [self._keys[self._start + j] for j in range(lo, hi, step)]
        n = self._stop - self._start
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("key window index out of range")
        return self._keys[self._start + i]

    def __iter__(self) -> Iterator[ChunkKey]:
        return map(self._keys.__getitem__, range(self._start, self._stop))

    def __repr__(self) -> str:
        return f"KeyWindow({self._start}:{self._stop} of {len(self._keys)})"


#: called with (tier, the keys it holds, their position in the lookup) for each run
OnHit = Callable[[Tier, list[ChunkKey], int], None]


def lookup_runs(stack: TierStack, keys: Sequence[ChunkKey], on_hit: OnHit | None = None) -> list[tuple[int, int]]:
    """``(tier level, chunks)`` runs of the longest prefix of ``keys`` the tiers in
    service hold, in prefix order; ``on_hit`` is told of each run (to pin it)."""
    runs: list[tuple[int, int]] = []
    total = len(keys)
    windows: list[int | None] = [None] * len(stack)  # None: all the remaining keys
    pos = 0
    while pos < total:
        advanced = False
        for tier in stack:
            w = windows[tier.level]
            stop = total if w is None else min(total, pos + w)
            if not tier.in_service:
                continue
            n = tier.contains(KeyWindow(keys, pos, stop))
            if n is None:
                continue
            windows[tier.level] = LOOKUP_WINDOW if n < stop - pos else (None if w is None else w * 4)
            if n > 0:
                if on_hit is not None:
                    on_hit(tier, list(keys[pos : pos + n]), pos)
                pos += n
                runs.append((tier.level, n))
                advanced = True
                break
        if not advanced:
            break
    return runs


def first_held(stack: TierStack, keys: Sequence[ChunkKey]) -> tuple[int, Tier] | None:
    """The first of ``keys`` (independent objects, in order of preference) that a tier
    in service holds, and the fastest tier holding it; ``None`` when none is held.
    Each tier is asked once for all the keys still unresolved (:meth:`Tier.held`)."""
    best: tuple[int, Tier] | None = None
    for tier in stack:
        if not tier.in_service:
            continue
        limit = len(keys) if best is None else best[0]
        if limit == 0:
            break
        found = tier.held(KeyWindow(keys, 0, limit))
        if found is not None:
            best = (found, tier)
    return best
