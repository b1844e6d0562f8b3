"""Canary pieces without an engine: sampling, the comparison and its tolerances, the
per-request option."""

from __future__ import annotations

import hashlib

import pytest
import torch

pytest.importorskip("vllm")

from lmcache_connector.options import parse_request_options  # noqa: E402
from lmcache_core.canary import compare, sample, tolerance  # noqa: E402


def _h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def test_sampling_is_deterministic_and_close_to_the_fraction():
    picks = [sample(0.01, _h(i % 7), i) for i in range(20_000)]
    assert picks == [sample(0.01, _h(i % 7), i) for i in range(20_000)]
    assert 150 <= sum(picks) <= 250  # 200 expected
    # a hot prefix (the same last hit chunk every time) is not always or never sampled
    hot = [sample(0.1, _h(0), i) for i in range(2000)]
    assert 140 <= sum(hot) <= 260
    assert not any(sample(0.0, _h(i), i) for i in range(1000))
    assert all(sample(1.0, _h(i), i) for i in range(1000))


def test_request_option_verify():
    assert parse_request_options({"lmcache.verify": True}).verify is True
    assert parse_request_options({"lmcache.verify": False}).verify is False
    assert parse_request_options({}).verify is None
    bad = parse_request_options({"lmcache.verify": "yes"})
    assert bad.problem and bad.skip_load and bad.verify is None


def _kv(seed: int, dtype: torch.dtype, shape=(4, 2, 256, 64)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compare_exact_low_bit_drift_and_another_chunk(dtype):
    fresh = _kv(1, dtype)
    assert compare(fresh.clone(), fresh) == (True, "bit-identical")
    # one ulp off in every element: what a different reduction order can do
    drift = torch.nextafter(fresh.float(), torch.full_like(fresh.float(), float("inf"))).to(dtype)
    if dtype != torch.float32:  # nextafter in fp32 rounds back to the same bf16/fp16
        bits = fresh.view(torch.int16) + 1
        drift = bits.view(dtype)
    ok, detail = compare(drift, fresh)
    assert ok and "within" in detail
    # another key's chunk (same distribution), and one wrong token of 256
    assert compare(_kv(2, dtype), fresh)[0] is False
    one = fresh.clone()
    one[:, :, 7] = _kv(3, dtype)[:, :, 7]
    ok, detail = compare(one, fresh)
    assert not ok and "above" in detail


def test_compare_raw_pages_as_their_element_type_and_exactly_otherwise():
    fresh = _kv(1, torch.bfloat16)
    pages = fresh.view(torch.uint8).reshape(-1)
    drift = (fresh.view(torch.int16) + 1).view(torch.uint8).reshape(-1)
    assert compare(drift, pages, torch.bfloat16)[0] is True
    assert compare(drift, pages)[0] is False  # bytes without a value type: exact only
    assert compare(_kv(2, torch.bfloat16).view(torch.uint8).reshape(-1), pages, torch.bfloat16)[0] is False
    assert compare(pages[:-2], pages)[0] is False  # another shape
    assert tolerance(torch.int8) == 0.0 and tolerance(torch.float8_e4m3fn) > tolerance(torch.bfloat16)
    nan = fresh.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert compare(nan, fresh)[0] is False
