"""The fp8 codec on real vLLM (CPU): a prompt saved through a disk tier with
``serde: fp8`` is loaded back as a hit, its frames intact.

Found by bench/bench_fp8_fidelity.py: vLLM's KV cache and the pool views made under it
are inference tensors, the disk tier decodes on its own threads outside inference
mode, and torch refused the codec's write there; every fp8 frame read back failed,
was counted corrupt and removed, and every load was recomputed. The unit test
tests/core/test_fp8_codec.py::test_decodes_into_inference_tensors_from_threads_outside_inference_mode
holds the codec to it; this one holds the whole path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import make_llm, random_prompt, run, token_ids, worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _computed_then_loaded(model: Path, prompt: list[int], disk: Path) -> tuple[Any, Any, Any]:
    """One engine with one fp8 disk tier: ``prompt`` computed (and saved), then asked
    again; both outputs and the tier's stats after the second."""
    tier = {"name": "disk", "path": str(disk), "max_size": "1GiB", "fsync": False, "serde": "fp8"}
    with make_llm(model, extra={"chunk_size": 256, "backends": [tier]}) as llm:
        (computed,) = run(llm, [prompt])
        engine = worker().engine
        assert engine.flush(120)
        (loaded,) = run(llm, [prompt])
        return computed, loaded, engine.tiers[0].stats()


def test_fp8_disk_tier_serves_hits_inside_vllm(tiny_model: Path, tmp_path: Path) -> None:
    computed, loaded, s = _computed_then_loaded(tiny_model, random_prompt(1500, 811), tmp_path / "disk")
    assert s.puts == 6  # 1500 tokens: 5 whole chunks of 256 and a block tail of 128
    assert loaded.num_cached_tokens == 1280 + 128, (loaded.num_cached_tokens, s)
    assert s.hits == 6 and s.extra["corrupt_removed"] == 0 and s.chunks == 6, s
    # Approximate KV, so the tokens are not required to match; they are reported.
    same = sum(a == b for a, b in zip(*token_ids([computed, loaded])))
    print(f"greedy tokens equal to the computed run's: {same}/{len(computed.outputs[0].token_ids)}")


def test_fp8_tier_stores_byte_pages_raw_for_a_sliding_window_model(tmp_path: Path) -> None:
    """A model whose cache the connector moves as byte pages (every layer with a
    sliding window: the grouped layout) cannot be quantized: the fp8 tier stores
    its chunks raw, so it still serves hits, and they are exact (identical greedy
    tokens). Before, every save was refused and the tier held nothing."""
    from lmcache_connector.dev.tiny_hybrid import build_hybrid_model

    model = build_hybrid_model(tmp_path / "mistral_sw", "mistral_sw")
    computed, loaded, s = _computed_then_loaded(model, random_prompt(1500, 812), tmp_path / "disk")
    # 5 chunks plus the window pages of the boundary (their own objects)
    assert loaded.num_cached_tokens == 1280 and s.hits >= 5 and s.extra["corrupt_removed"] == 0, (loaded.num_cached_tokens, s)
    assert token_ids([loaded]) == token_ids([computed])
