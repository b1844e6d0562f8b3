"""``lmcache-core warm`` on real vLLM: a corpus prefilled into a config's disk tier is
hit at once by a fresh engine with the same config (the greedy tokens those of a run
without the cache), and with ``preload`` a fresh engine's first requests read nothing
from disk; a rerun prefills nothing (every document looked up and skipped); Ctrl-C
leaves every stored chunk whole; bad corpus lines are
reported by number and skipped; a config of memory tiers only is refused."""

from __future__ import annotations

import argparse
import io
import json
import random
from pathlib import Path

import pytest
import yaml

from lmcache_connector.lookup_cmd import lookup
from lmcache_connector.warm import CorpusError, read_corpus, Summary, warm

from .conftest import greedy, make_llm, worker

CS = 256


def _args(model: Path, config: Path, jsonl: Path, **kw) -> argparse.Namespace:
    base = dict(
        model=str(model),
        config=config,
        jsonl=jsonl,
        dir=None,
        prefix="Document: ",
        chat_template=False,
        batch=2,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        limit=None,
        quiet=True,
    )
    return argparse.Namespace(**{**base, **kw})


def _lookup_args(model: Path, config: Path, **kw) -> argparse.Namespace:
    base = dict(model=str(model), config=config, text=None, jsonl=None, dir=None, prefix="Document: ", chat_template=False)
    base.update(namespace=None, cache_salt=None, lora=None, limit=1000, keys=False)
    return argparse.Namespace(**{**base, **kw})


def _docs(model: Path, n: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(7)
    return [tok.decode([rng.randrange(10, 2000) for _ in range(700 + 37 * i)]) for i in range(n)]


def test_the_corpus_reader_reports_bad_lines_by_number(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"prompt": "a"}\n\nnot json\n{"text": ""}\n[1]\n{"text": "b"}\n')
    s, err = Summary(), io.StringIO()
    args = argparse.Namespace(dir=None, jsonl=f)
    assert list(read_corpus(args, s, err)) == ["a", "b"]
    assert s.bad_lines == 3 and ":3: not JSON" in err.getvalue() and ":4: no non-empty" in err.getvalue()
    with pytest.raises(CorpusError, match="cannot open"):
        list(read_corpus(argparse.Namespace(dir=None, jsonl=tmp_path / "missing.jsonl"), s, err))


def test_a_memory_only_config_is_refused(tmp_path, tiny_model):
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(yaml.safe_dump({"backends": [{"name": "local_cpu", "max_size": "64MiB"}]}))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"prompt": "hello"}\n')
    with pytest.raises(CorpusError, match="stores nothing that outlives"):
        warm(_args(tiny_model, cfg, corpus))
    # a config that does not load: the error that says which key, not a traceback
    cfg.write_text("chunk_sise: 5\n")
    with pytest.raises(CorpusError, match=r"invalid configuration: chunk_sise: unknown key \(from .*lmcache.yaml\)"):
        warm(_args(tiny_model, cfg, corpus))


@pytest.mark.vllm
@pytest.mark.slow
def test_a_warmed_corpus_hits_at_once_on_a_fresh_engine(tmp_path, tiny_model):
    cfg = tmp_path / "lmcache.yaml"
    backends = [{"name": "local_cpu", "max_size": "64MiB"}, {"name": "disk", "path": str(tmp_path / "disk"), "max_size": "1GiB"}]
    cfg.write_text(yaml.safe_dump({"backends": backends}))
    docs = _docs(tiny_model, 5)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join([json.dumps({"prompt": d}) for d in docs[:2]] + ["{oops"] + [json.dumps({"text": d}) for d in docs[2:]])
    )
    first = warm(_args(tiny_model, cfg, corpus))
    assert first.documents == 5 and first.bad_lines == 1 and first.cached_tokens == 0 and not first.interrupted
    disk = next(t for t in first.tiers if t["name"] == "disk")
    assert disk["chunks"] >= sum(len(d) for d in docs) // 4 // CS  # whole chunks reached the disk tier
    assert first.skipped == 0 and first.too_short == 0, first
    # a rerun skips what is stored: no prefill at all (each document looked up first);
    # the control in the same run: a document that starts as a warmed one and goes on
    # is prefilled (its stored head loaded by vLLM, the rest computed), not skipped
    rerun = tmp_path / "rerun.jsonl"
    rerun.write_text(corpus.read_text() + "\n" + json.dumps({"prompt": docs[0] + docs[1]}) + "\n")
    again = warm(_args(tiny_model, cfg, rerun))
    assert again.documents == 6 and again.skipped == 5, again
    assert again.skipped_tokens == first.prompt_tokens, again  # the five warmed documents: nothing computed
    assert again.cached_tokens >= CS and again.computed_tokens > CS, again  # the grown one: head loaded, rest computed
    # lmcache-core lookup finds every whole chunk of every warmed document in the disk
    # tier (its offline hashes are the connector's); the control: an unwarmed one, none
    out = io.StringIO()
    rc = lookup(_lookup_args(tiny_model, cfg, text=[*docs, _docs(tiny_model, 6)[5]]), out, io.StringIO())
    lines = out.getvalue().splitlines()
    assert rc == 0, out.getvalue()
    for line in lines[:5]:
        whole = int(line.split(" whole chunks")[0].rsplit(" ", 1)[1])
        assert whole >= 2 and f"(disk) [rank 0/1] {whole}/{whole}" in line, line
    assert "(disk) [rank 0/1] 0/" in lines[5], lines[5]
    assert "backends[0] (local_cpu): not asked" in out.getvalue()
    # --keys: the chunk keys of the prompts, one a line: each names a chunk file of the
    # disk tier (the keys a node's admin API takes); the unwarmed document's name none
    files = {p.name for p in (tmp_path / "disk").rglob("v1-*")}
    out = io.StringIO()
    assert lookup(_lookup_args(tiny_model, cfg, text=docs, keys=True), out, io.StringIO()) == 0
    keys = out.getvalue().split()
    assert len(keys) == sum(int(line.split(" whole chunks")[0].rsplit(" ", 1)[1]) for line in lines[:5])
    assert set(keys) <= files and len(set(keys)) == len(keys)
    out = io.StringIO()
    assert lookup(_lookup_args(tiny_model, cfg, text=[_docs(tiny_model, 6)[5]], keys=True), out, io.StringIO()) == 0
    assert out.getvalue().split() and not set(out.getvalue().split()) & files
    # a fresh engine with the same config: every document's whole chunks hit at once
    questions = [f"Document: {d}\nQuestion: what is it about?" for d in docs]
    with make_llm(tiny_model, extra={"config_file": str(cfg)}, max_model_len=2048) as llm:
        tok = llm.get_tokenizer()
        outs = llm.generate(questions, greedy(), use_tqdm=False)
        warmed = [len(tok(f"Document: {d}")["input_ids"]) // CS * CS for d in docs]
        hits = [o.num_cached_tokens for o in outs]
        assert all(h >= w for h, w in zip(hits, warmed)), (hits, warmed)
        got = [list(o.outputs[0].token_ids) for o in outs]
        first_reads = worker().engine.tiers[1].stats().hits
    # with the config's preload, a fresh engine reads the warmed chunks into its CPU
    # tier at start: the first requests hit as much (or more) and read nothing from disk
    # (the engine above is the control: its first requests read the disk tier)
    assert first_reads > 0
    cfg.write_text(yaml.safe_dump({"backends": backends, "preload": "64MiB"}))
    with make_llm(tiny_model, extra={"config_file": str(cfg)}, max_model_len=2048) as llm:
        engine = worker().engine
        assert engine.preloader is not None and engine.preloader.done.wait(60)
        loaded = engine.preloader.result
        assert loaded.stopped == "every listed chunk read" and loaded.chunks >= sum(warmed) // CS, loaded
        disk_tier = engine.tiers[1]
        reads_before = disk_tier.stats().hits
        outs = llm.generate(questions, greedy(), use_tqdm=False)
        again = [o.num_cached_tokens for o in outs]
        assert all(p >= h for p, h in zip(again, hits)), (again, hits)  # more: a tail is cheap to load from memory
        assert disk_tier.stats().hits == reads_before, "a first request read the disk tier"
        preloaded = [list(o.outputs[0].token_ids) for o in outs]
    with make_llm(tiny_model, connector=False, max_model_len=2048) as llm:
        ref = [list(o.outputs[0].token_ids) for o in llm.generate(questions, greedy(), use_tqdm=False)]
    assert got == ref and preloaded == ref


def _chunk_files(disk: Path) -> list[Path]:
    """The disk tier's chunk files (names that are chunk keys), temps not counted."""
    from lmcache_core.keys import ChunkKey

    out = []
    for p in disk.rglob("v1-*") if disk.exists() else []:
        try:
            ChunkKey.parse(p.name)
        except ValueError:
            continue
        out.append(p)
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_leaves_every_stored_chunk_whole_and_a_rerun_finishes(tmp_path, tiny_model):
    """``lmcache-core warm`` interrupted with SIGINT (Ctrl-C) once chunks reach the disk
    tier: exit 130 with INTERRUPTED in its summary; every chunk file it left reads back
    whole (frame and checksum verified by the tier); a rerun skips what was stored and
    warms the rest, after which every whole chunk of every document is held."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    import torch

    from lmcache_core.erase import open_command_tiers
    from lmcache_core.keys import ChunkKey
    from lmcache_core.plugins import PluginManager

    cfg, disk = tmp_path / "lmcache.yaml", tmp_path / "disk"
    backends = [{"name": "local_cpu", "max_size": "64MiB"}, {"name": "disk", "path": str(disk), "max_size": "1GiB"}]
    cfg.write_text(yaml.safe_dump({"backends": backends}))
    docs = _docs(tiny_model, 8)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"prompt": d}) for d in docs) + "\n")
    exe = shutil.which("lmcache-core", path=os.path.dirname(sys.executable))
    assert exe, "install the core (pip install -e .) for its console script"
    cmd = [exe, "warm", "--model", str(tiny_model), "--config", str(cfg), "--jsonl", str(corpus), "--batch", "1"]
    cmd += ["--prefix", "Document: ", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20), "-q"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and len(_chunk_files(disk)) < 2:
            time.sleep(0.05)
        assert proc.poll() is None, "warm ended before it could be interrupted: " + proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130 and "INTERRUPTED" in out, (proc.returncode, out, err[-2000:])
    files = _chunk_files(disk)
    opened, _ = open_command_tiers(str(cfg), PluginManager())
    try:
        tier = next(o.tier for o in opened if o.tier is not None and o.tier.name == "disk")
        read = 0
        for ns in {ChunkKey.parse(p.name).namespace for p in files}:
            for sc in tier.stored_chunks(ns):
                buf = torch.empty(sc.shape, dtype=getattr(torch, sc.dtype))
                assert tier.get(sc.key, buf), sc.key
                read += 1
        assert read == len(files) >= 2, (read, len(files))
        assert tier.stats().extra["corrupt_removed"] == 0
    finally:
        for o in opened:
            if o.tier is not None:
                o.tier.close()
    print(f"\nwarm interrupted: {len(files)} chunk files left, all read back whole")
    again = warm(_args(tiny_model, cfg, corpus))
    assert again.documents == 8 and 1 <= again.skipped < 8 and again.computed_tokens > 0, again
    report = io.StringIO()
    assert lookup(_lookup_args(tiny_model, cfg, text=docs), report, io.StringIO()) == 0
    assert "(disk) [rank 0/1]: " in report.getvalue() and "held (100.0%)" in report.getvalue(), report.getvalue()
