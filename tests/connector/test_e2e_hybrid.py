"""Hybrid and sliding-window models on real vLLM (CPU) with the connector and vLLM's
hybrid KV cache manager on: Gemma 3 (interleaved sliding/full), a gpt-oss-style model
(sliding/full with sinks, MoE), GraniteMoeHybrid (Mamba2 + attention) and Qwen3-Next
(gated delta-net + attention, bf16). Small models with random weights, built here.

State-space models keep a recurrent state only where a scheduler step ends, so their
hits end at chunk boundaries where one did: their prompts go one request at a time
with a batch size that is a multiple of the chunk size (see docs/connector.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import greedy, make_llm, random_prompt, run, scheduler_side, token_ids, worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    family: str
    prompt_len: int
    hit: int  # tokens the connector serves on a repeat of each prompt
    one_by_one: bool = False
    llm: dict[str, Any] = field(default_factory=dict)


CASES = {
    "gemma3": Case("gemma3", 1500, 1280),  # window 160 < chunk 256
    "gpt_oss": Case("gpt_oss", 1500, 1280, llm={"dtype": "bfloat16"}),  # window 128
    # Mamba2 state at the step ends 512 and 1024 (vLLM-CPU cannot run Mamba2 in its
    # "align" cache mode: see docs/connector.md).
    "granite_hybrid": Case("granite_hybrid", 1500, 1024, one_by_one=True, llm={"max_num_batched_tokens": 512}),
    # Block size 384 for its GDN layers: chunk_size becomes 384; steps end at 768, 1536.
    # The first token computed after the hit reads the restored state directly (this
    # small model's GDN state fades within a few dozen tokens).
    "qwen3_next": Case("qwen3_next", 1537, 1536, one_by_one=True, llm={"dtype": "bfloat16", "max_num_batched_tokens": 768}),
}
# Single-group models that must keep working: a dense model whose every layer has a
# sliding window (grouped path: window pages in boundary objects), and MLA (dense block
# path). vLLM-CPU's MLA outputs change with how a prefill is split, and a request that
# starts from 1280 cached tokens and prefills 220 more takes another path than one that
# continues after 1280 (measured: greedy tokens diverge after 2-3 tokens even for a bit-exact
# copy of the cache: vLLM-CPU's rope kernel gives results that change with a step's token
# count; test_e2e_mla_context.py holds such a hit to vLLM's own split at the same token),
# so the MLA prompt leaves exactly one token after the hit, which vLLM
# computes with its MLA decode kernel. Its reference must compute that token the same way
# (``_mla_round_trip``): without AMX, vLLM-CPU's reference MLA backend turns chunked
# prefill off and prefills the whole prompt in one step, whose last token goes through
# the prefill kernel instead (logprobs ~0.2 apart, 2 of 3 greedy answers different on an
# AVX2-only AMD EPYC).
ROUND_TRIP_ONLY = {
    "mistral_sw": Case("mistral_sw", 1500, 1280),
    "deepseek_v2": Case("deepseek_v2", 1281, 1280, one_by_one=True, llm={"max_num_batched_tokens": 1280}),
}
N_PROMPTS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from lmcache_connector.dev.tiny_hybrid import build_hybrid_model

    root = tmp_path_factory.mktemp("hybrid-models")
    return {name: build_hybrid_model(root / name, name) for name in {**CASES, **ROUND_TRIP_ONLY}}


@pytest.fixture(scope="module")
def reference(models):
    """Greedy outputs without the connector (same engine settings), once per prompt."""
    cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def get(name: str, prompts: list[list[int]]) -> list[list[int]]:
        case = {**CASES, **ROUND_TRIP_ONLY}[name]
        missing = [p for p in prompts if (name, tuple(p)) not in cache]
        if missing:
            with make_llm(models[name], connector=False, **case.llm) as llm:
                for p, ids in zip(missing, token_ids(_generate(llm, case, missing))):
                    cache[(name, tuple(p))] = ids
        return [cache[(name, tuple(p))] for p in prompts]

    return get


def _prompts(case: Case) -> list[list[int]]:
    return [random_prompt(case.prompt_len, 900 + i) for i in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def mla_round_trip(models):
    """MLA prompts whose reference computes the token after the hit as a hit does:
    ``hit`` random tokens (the prefix), prefilled and continued greedily by vLLM without
    the connector; the prompt is the prefix and its first greedy token, so the prompt's
    last token goes through the decode kernel in the reference too, and the 8 greedy
    tokens after it are what a hit of the prefix must give. ``get()``: (prompts,
    tokens after the hit), computed on first use."""
    cache: list[tuple[list[list[int]], list[list[int]]]] = []

    def get() -> tuple[list[list[int]], list[list[int]]]:
        if not cache:
            case = ROUND_TRIP_ONLY["deepseek_v2"]
            prefixes = [random_prompt(case.hit, 900 + i) for i in range(N_PROMPTS)]
            with make_llm(models["deepseek_v2"], connector=False, **case.llm) as llm:
                cont = [token_ids(run(llm, [p], greedy(9)))[0] for p in prefixes]
            cache.append(([p + c[:1] for p, c in zip(prefixes, cont)], [c[1:] for c in cont]))
        return cache[0]

    return get


def _generate(llm: Any, case: Case, prompts: list[list[int]]) -> list[Any]:
    if case.one_by_one:
        return [o for p in prompts for o in run(llm, [p], greedy())]
    return run(llm, prompts, greedy())


def _flip_signs(buf: torch.Tensor) -> torch.Tensor:
    """The same bytes with the sign bit of every bf16/fp32 element flipped (finite,
    plausible, wrong)."""
    out = buf.clone()
    out[1::2] ^= 0x80
    return out


@pytest.mark.parametrize("name", [*CASES, *ROUND_TRIP_ONLY])
def test_hybrid_round_trip_hits_and_matches(models, reference, mla_round_trip, name):
    case = {**CASES, **ROUND_TRIP_ONLY}[name]
    prompts = mla_round_trip()[0] if name == "deepseek_v2" else _prompts(case)
    assert all(len(p) == case.prompt_len for p in prompts)
    ref = reference(name, prompts)
    warm_ref = mla_round_trip()[1] if name == "deepseek_v2" else ref
    with make_llm(models[name], **case.llm) as llm:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        w = worker()
        assert w.layout.kind == ("block" if name == "deepseek_v2" else "grouped")
        cold = _generate(llm, case, prompts)
        assert token_ids(cold) == ref
        assert [o.num_cached_tokens for o in cold] == [0] * N_PROMPTS
        warm = _generate(llm, case, prompts)
        assert [o.num_cached_tokens for o in warm] == [case.hit] * N_PROMPTS
        assert w.totals.loaded_tokens == case.hit * N_PROMPTS and w.totals.failed_loads == 0
        assert token_ids(warm) == warm_ref
        if w.layout.kind != "grouped":
            return
        # Negative control: the same hits with the boundary objects (sliding-window
        # pages, recurrent states) altered must change the outputs.
        original = w.layout.load_boundary
        w.layout.load_boundary = lambda buf, *a: original(_flip_signs(buf), *a)
        try:
            tampered = _generate(llm, case, prompts)
        finally:
            w.layout.load_boundary = original
        assert [o.num_cached_tokens for o in tampered] == [case.hit] * N_PROMPTS
        assert token_ids(tampered) != ref


def _engine(model: Path, config: dict[str, Any], prompts: list[list[int]], llm: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.connector.engine_proc",
            str(model),
            json.dumps(config),
            json.dumps(prompts),
            "--llm",
            json.dumps(llm),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    pytest.fail(f"engine process exited with {proc.returncode}: {proc.stderr[-3000:]}")


def _disk(path: Path) -> dict[str, Any]:
    return {"backends": [{"name": "local_cpu", "max_size": "256MiB"}, {"name": "disk", "path": str(path)}]}


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_fresh_process_hits_from_disk(models, reference, name, tmp_path):
    """Process A computes and stores; a fresh process B with an empty CPU tier hits
    from the disk tier with identical greedy tokens. Qwen3-Next runs with vLLM's
    prefix caching on here, so its GDN states come from vLLM's "align" cache mode."""
    pytest.importorskip("lmcache_backend_disk")
    case = CASES[name]
    prompts = _prompts(case)[:2]
    llm = {**case.llm, "one_by_one": case.one_by_one}
    if name == "qwen3_next":
        llm["enable_prefix_caching"] = True
    a = _engine(models[name], _disk(tmp_path / "kv"), prompts, llm)
    assert a["flushed"] and a["cached"] == [0, 0] and not a["hma_off"]
    b = _engine(models[name], _disk(tmp_path / "kv"), prompts, llm)
    assert b["cached"] == [case.hit, case.hit]
    assert {t["name"]: t["hits"] for t in b["tiers"]}["disk"] >= 2
    assert b["tokens"] == a["tokens"]
    if name != "qwen3_next":  # same engine settings as the reference (prefix caching off)
        assert b["tokens"] == reference(name, prompts)


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_corrupt_frames_are_recomputed(models, reference, name):
    """Every load from the tier fails its checksum: vLLM is told the request's load
    failed, recomputes it, outputs stay identical, and the engine keeps serving."""
    from lmcache_core.plugins import get_plugin_manager

    from .plugins_for_tests import FlakyPlugin

    case = CASES[name]
    prompts = _prompts(case)[:2]
    ref = reference(name, prompts)
    pm = get_plugin_manager()
    with pm.registered(FlakyPlugin(), name="test-flaky"):
        with make_llm(models[name], extra={"backends": [{"name": "flaky", "mode": "corrupt"}]}, **case.llm) as llm:
            assert token_ids(_generate(llm, case, prompts)) == ref
            again = _generate(llm, case, prompts)
            assert token_ids(again) == ref
            w = worker()
            assert w.totals.failed_loads == len(prompts) and w.totals.loaded_tokens == 0
            assert w.engine.tiers[0].stats().extra["corrupt_reads"] >= len(prompts)


def test_group_structure_is_in_the_namespace(models, tmp_path):
    """Objects written with the hybrid manager off (Gemma 3's sliding layers then keep
    the whole context, one group) are never loaded by an engine with it on, and the
    other way round; the same grouping hits (the control)."""
    pytest.importorskip("lmcache_backend_disk")
    case = CASES["gemma3"]
    prompts = _prompts(case)[:2]
    off = {"disable_hybrid_kv_cache_manager": True}
    a = _engine(models["gemma3"], _disk(tmp_path / "kv"), prompts, off)
    assert a["hma_off"] and a["flushed"]
    on = _engine(models["gemma3"], _disk(tmp_path / "kv"), prompts, {})
    assert not on["hma_off"] and on["cached"] == [0, 0]
    control = _engine(models["gemma3"], _disk(tmp_path / "kv"), prompts, off)
    # One group is the dense path: whole chunks, then the prompt's whole 128-token
    # blocks past them (its block tail, saved by engine a, found by its own key).
    dense_hit = min(case.prompt_len - 1, case.prompt_len // 128 * 128)
    assert dense_hit > case.hit  # the prompts do end with a whole block past their chunks
    assert control["cached"] == [dense_hit, dense_hit] and control["tokens"] == a["tokens"]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
def test_hybrid_multiprocess_mp_executor(models, name, monkeypatch):
    """vLLM's default multiprocess mode with the ``mp`` executor (what the API server
    runs): scheduler, engine core and worker in separate processes; the per-group plan
    and the asynchronous load completions cross those boundaries.

    Both engines (the reference without the connector, then with it) run their model
    on one OpenMP thread on core 0. Left to vLLM-CPU, the worker's cores depend on the
    connector (vLLM-CPU reserves one more core when a KV connector is configured; on a
    2-core host it then reserves none) and on the cores the test process was given:
    unpinned, this reference and the connector's cold pass (nothing loaded) part after
    4 greedy tokens on Qwen3-Next (bf16), and the old comparison with the in-process
    reference failed once in a CI run of the whole suite, depending on what ran before."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    case = CASES[name]
    prompts = _prompts(case)[:2]
    with make_llm(models[name], multiprocess=True, distributed_executor_backend="mp", connector=False, **case.llm) as llm:
        ref = token_ids(_generate(llm, case, prompts))
    with make_llm(models[name], multiprocess=True, distributed_executor_backend="mp", **case.llm) as llm:
        assert token_ids(_generate(llm, case, prompts)) == ref
        warm = _generate(llm, case, prompts)
        assert [o.num_cached_tokens for o in warm] == [case.hit, case.hit]
        assert token_ids(warm) == ref


@pytest.mark.parametrize("name", [*CASES, *ROUND_TRIP_ONLY])
def test_hybrid_canary_verifies_every_hit_without_mismatch(models, reference, name):
    """``verify_fraction: 1.0``: every hit's full-attention (or MLA latent) chunk objects
    are recomputed and compared with the stored ones; on honest tiers none differs, for
    every family the connector supports (fp32 and bf16; sliding/full, sinks and MoE,
    Mamba2 and gated delta-net hybrids, all-sliding, MLA at the same prefill split)."""
    case = {**CASES, **ROUND_TRIP_ONLY}[name]
    prompts = _prompts(case)[:2]
    ref = reference(name, prompts)
    with make_llm(models[name], extra={"verify_fraction": 1.0}, **case.llm) as llm:
        assert token_ids(_generate(llm, case, prompts)) == ref
        w = worker()
        warm = _generate(llm, case, prompts)
        assert [o.num_cached_tokens for o in warm] == [0, 0]  # recomputed, not loaded
        assert token_ids(warm) == ref
        assert w.totals.verified_chunks == len(prompts) * (case.hit // w.cfg.chunk_size)
        assert w.engine.stats()["verify_mismatches"] == {}
        assert w.totals.verify_inexact == 0


# -- states at every chunk boundary: the state scheduler ---------------------------------
# The README's serving settings: prefix caching off, and a batch large enough that vLLM
# prefills each prompt in one step. Prompt B shares its first SHARED tokens with prompt A.
SHARED = 1100
ONE_STEP = {"max_num_batched_tokens": 2048}
STATE_FAMILIES = ["granite_hybrid", "qwen3_next"]


def _shared_prefix_prompts() -> list[list[int]]:
    a = random_prompt(1500, 950)
    return [a, a[:SHARED] + random_prompt(400, 951)]


@pytest.fixture(scope="module")
def one_step_reference(models):
    """Greedy outputs of the shared-prefix prompts without the connector, one step each."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            with make_llm(models[name], connector=False, **{**CASES[name].llm, **ONE_STEP}) as llm:
                cache[name] = [token_ids(run(llm, [p], greedy()))[0] for p in _shared_prefix_prompts()]
                get.chunk[name] = _connector_chunk(llm)  # type: ignore[attr-defined]
        return cache[name]

    get.chunk = {}  # type: ignore[attr-defined]
    return get


def _connector_chunk(llm: Any) -> int:
    """The chunk the connector would use in this engine (vLLM without it): the default
    256 tokens as the connector adjusts it to the engine's groups
    (``layouts.groups.effective_chunk_size``). Read here, before any connector engine:
    in-process, vLLM keeps the last one's connector for later ones."""
    from lmcache_connector.layouts.groups import describe_groups, effective_chunk_size

    engine = llm.llm_engine
    kv_cache_config = engine.engine_core.engine_core.scheduler.kv_cache_config
    return effective_chunk_size(256, describe_groups(kv_cache_config, engine.vllm_config.cache_config.block_size))


@pytest.fixture(scope="module")
def chunk_step_reference(models):
    """Greedy outputs of the shared-prefix prompts without the connector, prefilled in
    steps of one chunk (``max_num_batched_tokens`` = the chunk): the step ends the state
    scheduler gives its prompts. In bf16 a prefill split changes logits in their last
    bits, and on some CPUs that flips a greedy tie: on an AVX2-only AMD EPYC, Granite's
    prompt A, token 8, one step against chunk steps, with or without the connector (the
    tests compare what the connector computes with the reference of the same split;
    vLLM's own scheduler, the control, with the one-step reference)."""
    cache: dict[tuple[str, int], list[list[int]]] = {}

    def get(name: str, chunk: int) -> list[list[int]]:
        if (name, chunk) not in cache:
            settings = {**CASES[name].llm, "max_num_batched_tokens": chunk}
            with make_llm(models[name], connector=False, **settings) as llm:
                cache[(name, chunk)] = [token_ids(run(llm, [p], greedy()))[0] for p in _shared_prefix_prompts()]
        return cache[(name, chunk)]

    return get


@pytest.mark.parametrize("name", STATE_FAMILIES)
def test_state_scheduler_hits_a_prefix_prefilled_in_one_step(models, one_step_reference, chunk_step_reference, name):
    """With ``StateBoundaryScheduler`` every prefill step ends on a chunk boundary, so
    prompt B (sharing 1,100 tokens with A) hits every whole chunk of the shared part:
    at least the bar of issue #32 (the shared length rounded down to chunks, minus one
    chunk); greedy tokens equal the engine without the connector prefilling in the same
    steps (``chunk_step_reference``). Negative control: vLLM's own scheduler, same
    settings, prefills A in one step and B finds no state (tokens: the one-step
    reference)."""
    from lmcache_connector.state_scheduler import QUALNAME

    case = CASES[name]
    a, b = _shared_prefix_prompts()
    settings = {**case.llm, **ONE_STEP}
    one_step = one_step_reference(name)
    chunk = one_step_reference.chunk[name]
    ref = chunk_step_reference(name, chunk)
    with make_llm(models[name], scheduler_cls=QUALNAME, **settings) as llm:
        assert worker().cfg.chunk_size == chunk
        whole = SHARED // chunk * chunk
        outs = [run(llm, [p], greedy())[0] for p in (a, b)]
        assert whole > 0 and [o.num_cached_tokens for o in outs] == [0, whole]  # above the bar (whole - chunk)
        assert token_ids(outs) == ref
    with make_llm(models[name], **settings) as llm:  # the control
        outs = [run(llm, [p], greedy())[0] for p in (a, b)]
        assert [o.num_cached_tokens for o in outs] == [0, 0]
        assert token_ids(outs) == one_step
    # the canary on the same run: B's hit is recomputed and compared, chunk by chunk
    with make_llm(models[name], scheduler_cls=QUALNAME, extra={"verify_fraction": 1.0}, **settings) as llm:
        outs = [run(llm, [p], greedy())[0] for p in (a, b)]
        w = worker()
        assert [o.num_cached_tokens for o in outs] == [0, 0] and token_ids(outs) == ref
        assert w.totals.verified_chunks == whole // chunk
        assert w.engine.stats()["verify_mismatches"] == {} and w.totals.verify_inexact == 0


@pytest.mark.parametrize(
    "name, prefix_caching",
    [("granite_hybrid", False), ("granite_hybrid", True), ("qwen3_next", False), ("qwen3_next", True)],
)
def test_state_scheduler_fresh_process_hits_from_disk(models, chunk_step_reference, name, prefix_caching, tmp_path):
    """The same from the disk tier across processes: A stores in one process, B hits
    in a fresh one (empty CPU tier, empty vLLM cache) with the greedy tokens of vLLM
    without the connector prefilling in chunk steps. Both also with vLLM's prefix
    caching on ("align" mode: the state scheduler adds its stops to vLLM's). vLLM-CPU
    0.32 alone crashes on Granite with prefix caching on when it prefills this prompt in
    one step (docs/connector.md); with the state scheduler's steps it runs (on an
    AVX2-only CPU, where Granite's block is smaller than a chunk, only since they end on
    vLLM's blocks: ``state_scheduler.unexportable_checkpoint_block``)."""
    pytest.importorskip("lmcache_backend_disk")
    from lmcache_connector.state_scheduler import QUALNAME

    a, b = _shared_prefix_prompts()
    llm = {**CASES[name].llm, **ONE_STEP, "scheduler_cls": QUALNAME, "enable_prefix_caching": prefix_caching}
    first = _engine(models[name], _disk(tmp_path / "kv"), [a], llm)
    assert first["flushed"] and first["cached"] == [0]
    second = _engine(models[name], _disk(tmp_path / "kv"), [b], llm)
    # the engine's chunk: 256, or vLLM's attention block size for Qwen3-Next's GDN layers
    # (384 on the CPUs CI ran on; another size on an AVX2-only AMD EPYC, where 384 failed)
    chunk = second["chunk_size"]
    assert chunk == first["chunk_size"] and (chunk == 256 or name == "qwen3_next")
    assert second["cached"] == [SHARED // chunk * chunk]
    assert second["loaded_tokens"] == SHARED // chunk * chunk  # from the tier, not vLLM's own cache
    assert {t["name"]: t["hits"] for t in second["tiers"]}["disk"] >= 1
    assert [first["tokens"][0], second["tokens"][0]] == chunk_step_reference(name, chunk)


ANSWER = 128


def _chat(llm: Any) -> tuple[list[list[int]], list[Any]]:
    """Four turns: each prompt is the previous prompt, its answer and a new message."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True, logprobs=0)
    prompt, prompts, outs = random_prompt(740, 970), [], []
    for turn in range(4):
        if turn:
            prompt = prompt + list(outs[-1].outputs[0].token_ids) + random_prompt(130, 971 + turn)
        prompts.append(prompt)
        outs.append(run(llm, [prompt], sp)[0])
    return prompts, outs


def _logprobs(out: Any) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]


def _diverge(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _settles_expected(prompts: list[list[int]], chunk: int) -> tuple[int, int, int, int, int]:
    """The settle counters (planned, finished, waits, gave up, in flight) after a
    chat: a turn is settled when its answer completes a chunk past its prompt's whole
    chunks (stored by its own prefill); the next turn waits for that settle; the last
    turn's is still queued (nothing ran the engine after it)."""
    settled = [(len(p) + ANSWER - 1) // chunk > len(p) // chunk for p in prompts]
    return sum(settled), sum(settled[:-1]), sum(settled[:-1]), 0, int(settled[-1])


@pytest.mark.parametrize("name", STATE_FAMILIES)
def test_state_chat_turns_resume_after_the_previous_answer(models, name):
    """A 4-turn chat with the state scheduler and ``connector.save_decode_cache:
    prefill``: when a turn finishes, an internal request (a settle) prefills the whole
    chunks of its answer, so turns 2-4 hit every whole chunk of the previous turn's
    prompt and answer, and every turn's 128 greedy tokens equal those of vLLM without
    the connector fed the same prompt. In process, a settle runs with the next turn,
    which waits for it (vLLM asks the connector again each step).

    The reference prefills in steps that end on the same chunk boundaries as the state
    scheduler's (``max_num_batched_tokens`` = one chunk): in bf16 a split changes logits
    by an ulp, and on some CPUs that flips an exact tie (seen: Granite, turn 4, token 60
    on an AMD EPYC, for the control too). Qwen3-Next also equals the one-step reference.

    Two more arms on the same chat. ``save_decode_cache: true`` stores the states and KV
    decode steps computed: the same hits, but what decode computes differs in its last
    bits from a prefill's and these random-weight models amplify it (greedy answers part
    after 0-96 tokens; the canary test below shows the difference), so only its hits are
    checked here. ``false`` (the control) hits only the chunks prefill steps reached:
    smaller hits, identical tokens."""
    from vllm import SamplingParams

    from lmcache_connector.state_scheduler import QUALNAME

    settings = {**CASES[name].llm, **ONE_STEP}
    runs, settles = {}, {}
    for mode in ("prefill", True, False):
        with make_llm(models[name], scheduler_cls=QUALNAME, extra={"connector": {"save_decode_cache": mode}}, **settings) as llm:
            chunk = worker().cfg.chunk_size
            runs[mode] = _chat(llm)
            s = scheduler_side(llm).settler
            settles[mode] = None if s is None else (s.planned, s.finished, s.waits, s.gave_up, s.in_flight)
    sp = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True, logprobs=0)
    with make_llm(models[name], connector=False, **{**settings, "max_num_batched_tokens": chunk}) as llm:
        ref = {m: [run(llm, [p], sp)[0] for p in runs[m][0]] for m in ("prefill", False)}
    prompts, outs = runs["prefill"]
    # KV exists for every token but the last one sampled: whole chunks of prompt + answer - 1
    expect = [0] + [(len(p) + ANSWER - 1) // chunk * chunk for p in prompts[:-1]]
    assert [o.num_cached_tokens for o in outs] == expect
    assert any(h > len(p) for h, p in zip(expect[1:], prompts))  # some hit ends inside an answer
    assert [_diverge(a, b) for a, b in zip(token_ids(outs), token_ids(ref["prefill"]))] == [None] * 4
    assert settles["prefill"] == _settles_expected(prompts, chunk) and settles["prefill"][0] >= 2
    assert settles[True] is None and settles[False] is None
    if name == "qwen3_next":
        with make_llm(models[name], connector=False, **settings) as llm:
            assert token_ids([run(llm, [p], sp)[0] for p in prompts]) == token_ids(outs)

    decode_prompts, decode_outs = runs[True]
    assert [o.num_cached_tokens for o in decode_outs] == [0] + [(len(p) + ANSWER) // chunk * chunk for p in decode_prompts[:-1]]

    control = [o.num_cached_tokens for o in runs[False][1]]
    assert all(c <= h for c, h in zip(control, expect)) and control != expect
    assert token_ids(runs[False][1]) == token_ids(ref[False])


@pytest.mark.parametrize("name", STATE_FAMILIES)
def test_state_chat_canary_finds_settled_answers_exact(models, name):
    """The canary on the same chat (``verify_fraction: 1.0``: every hit recomputed and
    compared with what the tiers hold, chunk by chunk). With ``save_decode_cache:
    prefill`` the answer chunks the settles stored are byte-identical to the next turn's
    recomputation: 0 mismatches, 0 inexact. Negative control, ``save_decode_cache:
    true``: the decode-computed chunks are not (the canary counts them inexact or
    mismatched), which is why ``prefill`` exists."""
    from lmcache_connector.state_scheduler import QUALNAME

    settings = {**CASES[name].llm, **ONE_STEP}
    seen = {}
    for mode in ("prefill", True):
        extra = {"verify_fraction": 1.0, "connector": {"save_decode_cache": mode}}
        with make_llm(models[name], scheduler_cls=QUALNAME, extra=extra, **settings) as llm:
            chunk = worker().cfg.chunk_size
            prompts, outs = _chat(llm)
            w = worker()
            assert [o.num_cached_tokens for o in outs] == [0] * 4  # every hit recomputed
            seen[mode] = (w.totals.verified_chunks, w.totals.verify_inexact, dict(w.engine.stats()["verify_mismatches"]))
    # turns 2-4 compare every whole chunk of the previous prompt and answer (and the settles
    # of turns 2-3 their prompt's): at least the chunks of the hits the chat would have had
    hits = sum((len(p) + ANSWER - 1) // chunk for p in prompts[:-1])
    verified, inexact, mismatches = seen["prefill"]
    assert verified >= hits and inexact == 0 and mismatches == {}
    verified, inexact, mismatches = seen[True]
    assert verified >= hits and (inexact > 0 or mismatches)
