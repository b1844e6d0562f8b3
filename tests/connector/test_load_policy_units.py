"""The load-or-recompute decision behind ``connector.load_policy: faster_than_recompute``, without
a vLLM engine: the attention work of a step is counted in token pairs; with nothing
measured yet every hit is loaded; a slow tier is bypassed while a fast one is loaded;
and a recompute cost that grows faster than the prompt gives a crossover length."""

from __future__ import annotations

from lmcache_connector.features.load_policy import PrefillModel, best_prefix, step_pairs

CS = 256


def _model(b: float, c: float = 0.0) -> PrefillModel:
    """An engine that takes ``1 ms + b*tokens + c*pairs`` per step."""
    m = PrefillModel()
    for n in (64, 300, 700, 1200, 2000, 3000):
        pairs = step_pairs([(0, n)])
        m.record(n, pairs, 0.001 + b * n + c * pairs)
    return m


def test_step_pairs_counts_attention_work() -> None:
    assert step_pairs([(0, 1)]) == 1  # one token attends to itself
    assert step_pairs([(0, 4)]) == 1 + 2 + 3 + 4
    assert step_pairs([(10, 1), (0, 0)]) == 11  # a decode step over 10 cached tokens


def test_no_model_yet_loads_everything() -> None:
    assert best_prefix([1.0] * 4, CS, PrefillModel(), 0.2) == 4


def test_slow_tier_bypassed_fast_tier_loaded() -> None:
    m = _model(b=1e-4)  # 25.6 ms per chunk to recompute
    assert m.recompute_seconds(CS) is not None and abs(m.recompute_seconds(CS) - 0.0256) < 1e-3
    assert best_prefix([0.3] * 4, CS, m, 0.2) == 0  # 300 ms per chunk: never worth it
    assert best_prefix([0.001] * 4, CS, m, 0.2) == 4
    assert best_prefix([0.0] * 4, CS, m, 0.2) == 4  # a free (unmeasured) tier is loaded
    # a fast prefix (CPU tier) then slow chunks: only the fast part loads
    assert best_prefix([0.001, 0.001, 0.3, 0.3], CS, m, 0.2) == 2
    # the margin: a load only 10% faster than recomputing is not taken with a 20% margin
    assert best_prefix([0.9 * 0.0256] * 4, CS, m, 0.2) == 0
    assert best_prefix([0.9 * 0.0256] * 4, CS, m, 0.0) == 4


def test_superlinear_recompute_gives_a_crossover() -> None:
    m = _model(b=2e-5, c=2e-8)
    per_chunk = [0.02] * 64
    short = best_prefix(per_chunk[:2], CS, m, 0.2)
    long = best_prefix(per_chunk[:32], CS, m, 0.2)
    assert short == 0 and long == 32
