"""A request's pins: what a lookup pinned in the tiers, held until the request's load
is over, released once.

Life cycle (one ``pin_id`` per request, the connector uses the request id):

1. **prepare** (:meth:`CacheEngine.lookup_runs` with ``pin_id``): the hit's chunks in
   every pinning tier are pinned, replacing whatever the id held before
   (:meth:`PinBook.begin`: a request looked up again starts over);
2. **narrow** (optional): :meth:`PinBook.keep` keeps the first ``n`` chunks of the hit
   (the prefix worth loading) and releases the rest; an object probed next to the hit
   (a boundary object, an offered chunk after it: ``add_pins=True`` or
   :meth:`CacheEngine.probe_boundary`) is added to the same id and kept with it;
3. **complete** (:meth:`PinBook.release`): everything the id holds is unpinned, and
   the id's prefetch cancelled. Called once wherever the request's load ends (loaded,
   load failed, finished or aborted before it loaded, preempted); a second release,
   or a release of an id that holds nothing, does nothing.

The book is the only owner of the pins a lookup takes: tiers see ``pin``/``unpin``
calls only from here.
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Sequence

from .keys import ChunkKey
from .tiers import Tier

#: a pinned run's position when it is an object added next to the hit (not part of
#: the prefix, so :meth:`PinBook.keep` never cuts it)
ADDED = -1


class PinnedRun(NamedTuple):
    tier: Tier
    keys: list[ChunkKey]
    #: the position of ``keys[0]`` in the lookup's prefix, or :data:`ADDED`
    pos: int


class PinBook:
    """The pins every request holds, by pin id (thread-safe)."""

    def __init__(self, on_release: Callable[[str], object] = lambda pin_id: None) -> None:
        """``on_release(pin_id)`` runs on every release (the engine cancels the
        id's prefetch there)."""
        self._runs: dict[str, list[PinnedRun]] = {}
        self._lock = threading.Lock()
        self._on_release = on_release

    def take(self, pin_id: str, tier: Tier, keys: list[ChunkKey], pos: int) -> None:
        """Pin ``keys`` in ``tier`` for ``pin_id`` (nothing when the tier takes no pins)."""
        if not tier.pin(keys):
            return
        with self._lock:
            self._runs.setdefault(pin_id, []).append(PinnedRun(tier, keys, pos))

    def begin(self, pin_id: str) -> None:
        """A new lookup under ``pin_id`` (prepare): whatever the id still holds from an
        earlier one (a request looked up again) is released first."""
        with self._lock:
            held = pin_id in self._runs
        if held:
            self.release(pin_id)

    def release(self, pin_id: str) -> None:
        """Release everything ``pin_id`` holds (see the module's life cycle)."""
        with self._lock:
            runs = self._runs.pop(pin_id, None)
        self._on_release(pin_id)
        _unpin(runs or ())

    def keep(self, pin_id: str, n_chunks: int) -> None:
        """Keep only the first ``n_chunks`` chunks of ``pin_id``'s hit pinned; objects
        added next to the hit stay pinned. An unknown id is ignored."""
        drop: list[PinnedRun] = []
        with self._lock:
            runs = self._runs.pop(pin_id, [])
            keep = []
            for run in runs:
                cut = len(run.keys) if run.pos == ADDED else max(0, min(len(run.keys), n_chunks - run.pos))
                if cut:
                    keep.append(run._replace(keys=run.keys[:cut]))
                if cut < len(run.keys):
                    drop.append(run._replace(keys=run.keys[cut:], pos=run.pos + cut))
            if keep:
                self._runs[pin_id] = keep
        _unpin(drop)

    def ids(self) -> set[str]:
        """The pin ids holding pins now (requests between lookup and release)."""
        with self._lock:
            return set(self._runs)

    def held(self, pin_id: str) -> int:
        """How many keys ``pin_id`` holds pinned (0 for an unknown id)."""
        with self._lock:
            return sum(len(run.keys) for run in self._runs.get(pin_id, ()))


def _unpin(runs: Sequence[PinnedRun]) -> None:
    for run in runs:
        run.tier.unpin(run.keys)
