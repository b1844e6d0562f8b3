"""Correctness canary on real vLLM (CPU): sampled hits are recomputed and compared
with the cache; a tier that serves another key's chunk (in a valid frame) is caught
and quarantined; honest tiers never mismatch."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache_core import metrics as m
from lmcache_core.cli import main as cli_main
from lmcache_core.plugins import get_plugin_manager
from lmcache_core.quarantine import RECHECK_S, list_control_files

from .conftest import greedy, make_llm, random_prompt, run, token_ids, worker
from .plugins_for_tests import LiarPlugin

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CS = 256
LIMIT = 3


def _prompts(n: int) -> list[list[int]]:
    """One prompt of a single repeated token first: the liar answers others with its
    chunks, whose KV is far from a random prompt's (random prompts' KV averages out
    alike in this small random-weight model, so swapping those changes little)."""
    return [[7] * 600] + [random_prompt(600, 1700 + i) for i in range(n - 1)]


def _liar_engine(tiny_model: Path, fraction: float, qdir: Path) -> Any:
    extra = {
        "backends": [{"name": "liar"}],
        "verify_fraction": fraction,
        "verify_mismatch_limit": LIMIT,
        "quarantine_dir": str(qdir),
    }
    return make_llm(tiny_model, extra=extra)


def test_lying_tier_is_caught_quarantined_and_released(tiny_model, reference, tmp_path, caplog):
    prompts = _prompts(6)
    ref = reference(prompts)
    before = m.VERIFY_MISMATCHES.labels("liar")._value.get()
    pm = get_plugin_manager()
    caplog.set_level(logging.WARNING, logger="lmcache_core")
    with pm.registered(LiarPlugin(), name="test-liar"), _liar_engine(tiny_model, 0.4, tmp_path) as llm:
        assert token_ids(run(llm, prompts)) == ref  # cold: stored (honestly)
        w = worker()
        eng = w.engine
        rows = []  # (cached tokens, chunks verified, quarantined after, tokens)
        for p in prompts * 2:
            v0 = w.totals.verified_chunks
            out = run(llm, [p])[0]
            rows.append(
                (
                    out.num_cached_tokens,
                    w.totals.verified_chunks - v0,
                    eng.quarantine.is_quarantined("liar"),
                    list(out.outputs[0].token_ids),
                )
            )
        sampled = [i for i, r in enumerate(rows) if r[1]]
        assert sampled, "no request was sampled: the test proves nothing"
        caught = next(i for i, r in enumerate(rows) if r[2])
        # detected within the sampled requests: quarantined by the sampled request that
        # brought the mismatches to the limit (2 chunks per request)
        assert caught == sampled[(LIMIT + 1) // 2 - 1]
        assert eng.stats()["verify_mismatches"] == {"liar": LIMIT}
        assert m.VERIFY_MISMATCHES.labels("liar")._value.get() == before + LIMIT
        assert m.TIER_QUARANTINED.labels("liar")._value.get() == 1
        assert any("differs from its recomputation" in r.getMessage() and "liar" in r.getMessage() for r in caplog.records)
        assert any("QUARANTINED" in r.getMessage() for r in caplog.records)
        # a sampled request recomputes: correct whatever the tier holds
        for i in sampled:
            assert rows[i][0] == 0 and rows[i][3] == ref[i % len(prompts)]
        # after the quarantine: no reads from the liar, outputs identical
        after = rows[caught + 1 :]
        assert after and all(r[0] == 0 for r in after)
        assert [r[3] for r in after] == [ref[i % len(prompts)] for i in range(caught + 1, len(rows))]
        assert w.counters()["tier_quarantined/liar"] == 1
        # an operator releases it (the engine re-reads its control file within RECHECK_S)
        assert [f.tier for f in list_control_files(tmp_path)] == ["liar"]
        assert cli_main(["quarantine", "release", "liar", "--dir", str(tmp_path)]) == 0
        eng.quarantine._held["liar"].checked -= RECHECK_S  # rather than sleeping
        again = run(llm, [prompts[0]], greedy(params={"lmcache.verify": False}))
        assert again[0].num_cached_tokens == 2 * CS  # served by the (lying) tier again
        assert m.TIER_QUARANTINED.labels("liar")._value.get() == 0


def test_negative_control_without_canary_the_liar_changes_outputs(tiny_model, reference, tmp_path):
    prompts = _prompts(3)
    ref = reference(prompts)
    pm = get_plugin_manager()
    with pm.registered(LiarPlugin(), name="test-liar"), _liar_engine(tiny_model, 0.0, tmp_path) as llm:
        run(llm, prompts)
        warm = [run(llm, [p])[0] for p in prompts]
        assert [o.num_cached_tokens for o in warm] == [2 * CS] * 3
        assert token_ids(warm) != ref
        assert worker().totals.verified_chunks == 0 and worker().engine.tiers[0].stats().extra["lies"] >= 6


# Relative error, over a chunk, of a recomputation that is not bit-identical because
# the store ran in another batch shape: a few elements one rounding step apart (measured
# 1.6e-7 in bf16 on an AVX2-only AMD EPYC, 0 on the AVX-512 CPU CI ran on first; see
# docs/canary.md). Far below the canary's tolerances (bf16 3e-2), and below one ulp of
# every element (~4e-3 in bf16); another prompt's chunk is off by about 1.
ROUNDING_DRIFT = 1e-4


def _relative_error(stored: torch.Tensor, fresh: torch.Tensor) -> float:
    a, b = stored.to(torch.float64), fresh.to(torch.float64)
    return float(torch.linalg.vector_norm(a - b)) / max(float(torch.linalg.vector_norm(b)), 1e-30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_everything_on_honest_tiers_finds_no_mismatch(tiny_model, reference, dtype, monkeypatch):
    """verify_fraction 1.0 over the mixed workload of the dense end-to-end tests: the
    store ran batched (chunked prefill of many requests at once), the recompute one
    request at a time; every hit is compared, none differs.

    Whether the two are bit-identical depends on the CPU (vLLM-CPU's kernels block
    their sums by batch shape: bit for bit on the AVX-512 CPU CI ran on first, a few
    chunks one rounding step apart on an AVX2-only AMD EPYC). So every chunk the canary
    counts inexact is measured here: its relative error must be rounding drift
    (``ROUNDING_DRIFT``), which a chunk of another prompt (the negative control,
    measured the same way) is far above."""
    from lmcache_connector.transfers import chunks

    prefixes = [random_prompt(2 * CS, 50 + i) for i in range(4)]
    prompts = [prefixes[i % 4] + random_prompt(60 + 7 * i, 60 + i) for i in range(8)]
    prompts += [random_prompt(300 + 11 * i, 80 + i) for i in range(3)]
    kw = {} if dtype == "float32" else {"dtype": dtype}
    ref = reference(prompts) if dtype == "float32" else None
    inexact: list[float] = []  # relative error of each chunk equal only within tolerance
    fresh_chunks: list[torch.Tensor] = []  # every recomputed chunk, for the negative control
    compare = chunks.compare

    def measured(stored: torch.Tensor, fresh: torch.Tensor, value_dtype: torch.dtype | None = None) -> tuple[bool, str]:
        equal, detail = compare(stored, fresh, value_dtype)
        if equal and detail != "bit-identical":
            inexact.append(_relative_error(stored, fresh))
        fresh_chunks.append(fresh.clone())
        return equal, detail

    monkeypatch.setattr(chunks, "compare", measured)
    with make_llm(tiny_model, max_num_batched_tokens=1024, extra={"verify_fraction": 1.0}, **kw) as llm:
        cold = token_ids(run(llm, prompts))
        if ref is not None:
            assert cold == ref
        w = worker()
        warm = [run(llm, [p])[0] for p in prompts]
        assert all(o.num_cached_tokens == 0 for o in warm)  # every hit recomputed, none loaded
        assert token_ids(warm) == cold
        # 4 shared 2-chunk prefixes (verified by each request that hits them) + 3 one-chunk prompts
        assert w.totals.verified_chunks >= 8 * 2 + 3
        assert w.engine.stats()["verify_mismatches"] == {}
        assert w.engine.quarantine.quarantined() == []
        assert w.totals.verify_inexact == len(inexact)  # every inexact verdict was measured
        assert all(e <= ROUNDING_DRIFT for e in inexact), inexact
    # negative control: the same measure tells another prompt's chunk from rounding drift
    other = next(c for c in fresh_chunks if not torch.equal(c, fresh_chunks[0]))
    assert _relative_error(other, fresh_chunks[0]) > 100 * ROUNDING_DRIFT
