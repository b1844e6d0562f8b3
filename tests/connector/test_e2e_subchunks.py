"""Sub-chunk hits on real vLLM (CPU: blocks of 128 tokens, chunks of 256): a prompt
that shares a stored chunk's first block but not its rest loads that block from the
stored chunk, as vLLM's own prefix cache would serve it, with identical tokens."""

from __future__ import annotations

import pytest

from .conftest import make_llm, random_prompt, run, token_ids, worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CS, BS = 256, 128


@pytest.mark.parametrize(
    "extra",
    [{}, {"connector": {"layerwise": True}}, {"connector": {"async_loads": True}}],
    ids=["sync", "layerwise", "async_loads"],
)
def test_shared_first_block_of_a_chunk_is_loaded(tiny_model, reference, extra):
    # a and b share 3 chunks and 150 tokens of the 4th: one whole block of it
    shared = random_prompt(3 * CS + 150, 401)
    a = shared + random_prompt(300, 402)
    b = shared + random_prompt(300, 403)
    c = a[: 3 * CS + 140]  # ends inside the stored chunk: its own partial chunk is not stored
    ref = reference([a, b, c])
    with make_llm(tiny_model, extra=extra) as llm:
        assert token_ids(run(llm, [a])) == ref[:1]
        w = worker()
        before = w.stats()["loaded_tokens"]
        out = run(llm, [b])
        assert out[0].num_cached_tokens == 3 * CS + BS
        assert w.stats()["loaded_tokens"] - before == 3 * CS + BS
        assert token_ids(out) == ref[1:2]
        out = run(llm, [c])
        assert out[0].num_cached_tokens == 3 * CS + BS
        assert w.stats()["loaded_tokens"] - before == 2 * (3 * CS + BS)
        assert token_ids(out) == ref[2:]
        # vLLM counts a failed load as cached too (then recomputes it): none failed
        assert w.stats()["failed_loads"] == 0


def test_switched_off_loads_whole_chunks_only(tiny_model, reference):
    """Negative control: without sub-chunk hits the same prompts hit 3 chunks."""
    shared = random_prompt(3 * CS + 150, 401)
    a = shared + random_prompt(300, 402)
    b = shared + random_prompt(300, 403)
    ref = reference([a, b])
    with make_llm(tiny_model, extra={"connector": {"sub_chunk_hits": False}}) as llm:
        run(llm, [a])
        out = run(llm, [b])
        assert out[0].num_cached_tokens == 3 * CS
        assert token_ids(out) == ref[1:]


def test_prompt_block_tail_is_saved_and_hit(tiny_model, reference):
    """A prompt's whole blocks past its last whole chunk are saved (its "block tail"):
    the same prompt again, and one that shares them, hit them as vLLM's own prefix
    cache would; a remainder shorter than a block saves nothing more."""
    a = random_prompt(2 * CS + 200, 411)  # 2 chunks, then one whole block and 72 tokens
    b = a[: 2 * CS + 150] + random_prompt(100, 412)
    short = random_prompt(CS + 100, 413)  # 1 chunk and less than a block
    ref = reference([a, b, short])
    with make_llm(tiny_model) as llm:
        assert token_ids(run(llm, [a, short])) == [ref[0], ref[2]]
        eng = worker().engine
        assert eng.stats()["stored_chunks"] == 3 + 1  # a: 2 chunks + its block tail; short: 1 chunk
        out = run(llm, [a, b, short])
        assert [o.num_cached_tokens for o in out] == [2 * CS + BS, 2 * CS + BS, CS]
        assert token_ids(out) == ref
        assert worker().stats()["failed_loads"] == 0


def test_a_fresh_engine_finds_a_block_tail_inside_a_whole_chunk(tiny_model, reference, tmp_path):
    """Prompt ``a`` (2 chunks, then one whole block and 72 tokens) saves its block tail.
    A fresh engine on the same disk tier (its sub-chunk index empty, as after a restart
    or on another instance), asked a prompt that shares a's 2 chunks and that block and
    goes on past the third chunk's end, loads the block by the block tail's own key.
    Negative control: the same with sub-chunk hits off loads the 2 chunks only."""
    pytest.importorskip("lmcache_backend_disk")
    a = random_prompt(2 * CS + 200, 421)
    d = a[: 2 * CS + 150] + random_prompt(300, 422)  # chunk 2 is whole in d; its first block is a's tail
    control = a[: 2 * CS + 150] + random_prompt(300, 423)
    ref = reference([a, d, control])
    tiers = [{"name": "local_cpu", "max_size": "256MiB"}, {"name": "disk", "path": str(tmp_path / "kv")}]
    with make_llm(tiny_model, extra={"backends": tiers}) as llm:
        assert token_ids(run(llm, [a])) == ref[:1]
        assert worker().engine.flush(30)
    for prompt, on, cached, want in ((d, True, 2 * CS + BS, ref[1]), (control, False, 2 * CS, ref[2])):
        with make_llm(tiny_model, extra={"backends": tiers, "connector": {"sub_chunk_hits": on}}) as llm:
            out = run(llm, [prompt])
            assert out[0].num_cached_tokens == cached, on
            assert token_ids(out) == [want]
            assert worker().stats()["failed_loads"] == 0
