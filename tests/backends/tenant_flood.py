"""The tenant-quota tests' flood: writers of one tenant writing many times its quota
while a sampler reads the tenant's bytes, every thread bounded in count and time.

Shared by the tiers' quota tests (``test_*_tenant_quotas.py``): each gives its own
writers (tier instances, as separate engines would be), its own put and its own
snapshot (the tenant's bytes and the ledger's count, read at one instant)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence, TypeVar

W = TypeVar("W")
S = TypeVar("S")

FIRST = 1000
"""The flood's chunk numbers start here (a test's other tenants use small ones)."""


def flood(
    writers: Sequence[W],
    put: Callable[[W, int], object],
    chunks: int,
    snapshot: Callable[[], S],
    *,
    deadline_s: float,
    samples_max: int,
) -> list[S]:
    """``chunks`` puts split evenly over ``writers`` (``put(writer, i)``, each writer
    in its own thread, chunk numbers from :data:`FIRST`) while ``snapshot`` is sampled
    as often as it returns, at most ``samples_max`` times, and once more at the end;
    the samples. Every thread must end within ``deadline_s``."""
    samples: list[S] = []
    done = threading.Event()
    per_writer = chunks // len(writers)

    def write(w: W, first: int) -> None:
        for i in range(first, first + per_writer):
            put(w, i)

    def sample() -> None:
        deadline = time.monotonic() + deadline_s
        while not done.is_set() and len(samples) < samples_max and time.monotonic() < deadline:
            samples.append(snapshot())
        samples.append(snapshot())

    threads = [threading.Thread(target=write, args=(w, FIRST + j * per_writer)) for j, w in enumerate(writers)]
    sampler = threading.Thread(target=sample)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=deadline_s)
    done.set()
    sampler.join(timeout=deadline_s)
    assert not any(t.is_alive() for t in [*threads, sampler]), "a flood thread overran its deadline"
    return samples
