"""``connector.load_policy: faster_than_recompute``: load a cached prefix only when reading it
beats recomputing it.

Both sides are measured online in the worker, where the cache lives:

- reading: the engine fits each tier's ``latency + bytes / throughput`` from its
  reads (:class:`lmcache_core.loadcost.TierReadModel`);
- recomputing: the worker times every forward pass (from the end of
  ``start_load_kv`` to ``wait_for_save``) against what the scheduler says the step
  computes: ``tokens`` and attention ``pairs`` (each scheduled token times the
  context it attends to). The fit ``seconds = a + b * tokens + c * pairs`` gives the
  marginal cost of recomputing a prefix of ``h`` tokens instead of loading it:
  ``b * h + c * h^2 / 2`` (the rest of the prompt attends to the prefix either way).

For a lookup whose hits come from tiers ``t_0, t_1, ...`` (chunk by chunk), the
policy keeps the prefix ``k`` that maximises ``(1 - margin) * recompute(k) -
load(k)`` and reports the chunks past it as misses (``bypassed``). Before the
engine has been timed (``MIN_STEPS`` forward passes) everything is loaded; a tier
that has never been read, or not for ``REPROBE_S`` seconds, counts as free, so one
load measures it again (a slow tier that recovers is noticed).
"""

from __future__ import annotations

import math
from typing import Sequence

from lmcache_core.loadcost import LinearFit

MIN_STEPS = 4
REPROBE_S = 60.0
ALWAYS = "always"
FASTER = "faster_than_recompute"


class PrefillModel:
    """The engine's compute time per step: ``a + b * tokens + c * pairs``."""

    def __init__(self, window: int = 64) -> None:
        self.fit = LinearFit(2, window=window, min_samples=MIN_STEPS)

    def record(self, tokens: int, pairs: float, seconds: float) -> None:
        if tokens > 0:
            self.fit.add((tokens, pairs), seconds)

    def recompute_seconds(self, h: int) -> float | None:
        """Extra seconds to compute a prefix of ``h`` tokens rather than load it."""
        coef = self.fit.coefficients()
        if coef is None:
            return None
        return float(coef[1] * h + coef[2] * h * h / 2)


def step_pairs(sched: Sequence[tuple[int, int]]) -> float:
    """Attention pairs of a step from ``(computed_before, scheduled)`` per request."""
    return float(sum(n * (c + (n + 1) / 2) for c, n in sched if n > 0))


def best_prefix(chunk_load_s: Sequence[float], chunk_tokens: int, recompute: PrefillModel, margin: float) -> int:
    """How many leading chunks to load (see the module docstring). ``chunk_load_s[i]``
    is the predicted read time of chunk ``i``."""
    if recompute.recompute_seconds(chunk_tokens) is None:
        return len(chunk_load_s)
    best_k, best_gain, load = 0, 0.0, 0.0
    for k, s in enumerate(chunk_load_s, start=1):
        load += s
        saved = recompute.recompute_seconds(k * chunk_tokens) or 0.0
        gain = (1.0 - margin) * saved - load
        if gain >= best_gain and math.isfinite(gain):  # ties: load (equal cost, less compute)
            best_k, best_gain = k, gain
    return best_k
