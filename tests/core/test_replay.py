"""``lmcache-core replay``: Mooncake traces parsed strictly (every bad line named by
file and line, never a traceback), a hand-built trace whose LRU hits are known, the
offline optimum checked against an exhaustive search and against every policy, and
the command end to end (table, JSON, the sweep's PNG, a config's tiers)."""

from __future__ import annotations

import itertools
import json
import random
import struct
import zlib
from pathlib import Path
from typing import Sequence

import pytest

from lmcache_core import cli, traces
from lmcache_core.pngplot import PNG_SIGNATURE, check_png
from lmcache_core.replay import (
    Progress,
    ceiling_hits,
    chain_keys,
    cpu_config,
    crossing,
    full_capacity,
    next_uses,
    optimum_hits,
    optimum_run,
    parse_sizes,
    replay_engine,
    tail_tokens,
)
from lmcache_core.traces import TraceError, load_trace


def req(ids: Sequence[int], ts: float = 0, input_length: int | None = None) -> str:
    n = len(ids) * 512 - 100 if input_length is None else input_length
    return json.dumps({"timestamp": ts, "input_length": max(n, 0), "output_length": 10, "hash_ids": list(ids)})


def write(tmp_path: Path, lines: Sequence[str | bytes], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return p


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["replay", *args, "--quiet"])
    out, err = capsys.readouterr()
    return rc, out, err


# -- parsing ------------------------------------------------------------------------------
def test_parse_builds_the_prefix_tree(tmp_path: Path) -> None:
    p = write(tmp_path, [req([0, 1, 2]), "", req([0, 1, 5], ts=3.5), req([7, 1]), req([])])
    t = load_trace(p)
    assert t.requests == 4 and t.blocks == 8 and t.lines_read == 5
    assert [list(t.path_of(i)) for i in range(4)] == [[0, 1, 2], [0, 1, 3], [4, 5], []]
    # id 1 under 7 is another block than id 1 under 0: nodes are prefixes, not ids
    assert list(t.parents) == [-1, 0, 1, 1, -1, 4] and list(t.block_ids) == [0, 1, 2, 5, 7, 1]
    assert t.distinct_blocks == 6 and t.span_ms() == 3.5
    keys = chain_keys(t)
    assert len(set(keys)) == 6 and all(len(k) == 16 for k in keys)
    assert load_trace(p, limit=2).requests == 2


BAD_LINES: list[tuple[str, bytes | str, str]] = [
    ("bad json", '{"timestamp": 0, "input_length": 5', "not valid JSON"),
    ("not an object", "[1, 2, 3]", "expected a JSON object, got list"),
    ("null", "null", "expected a JSON object, got null"),
    ("missing field", '{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field hash_ids"),
    ("missing fields", '{"hash_ids": []}', "missing fields timestamp, input_length, output_length"),
    ("string length", '{"timestamp": 0, "input_length": "512", "output_length": 1, "hash_ids": [1]}', "input_length: expected"),
    ("float length", '{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": [1]}', "input_length: expected"),
    ("bool length", '{"timestamp": 0, "input_length": 5, "output_length": true, "hash_ids": [1]}', "output_length: expected"),
    ("negative length", '{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": [1]}', "must not be negative"),
    ("absurd length", '{"timestamp": 0, "input_length": 1099511627776, "output_length": 1, "hash_ids": [1]}', "is larger than"),
    ("string ts", '{"timestamp": "now", "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp: expected"),
    (
        "negative ts",
        '{"timestamp": -5, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
        "timestamp: must not be negative",
    ),
    ("nan ts", '{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "NaN is not a number"),
    ("inf ts", '{"timestamp": 1e999, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "not a plausible"),
    ("ids not a list", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "0,1"}', "hash_ids: expected a list"),
    ("string id", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "2"]}', "hash_ids[1]: expected"),
    ("float id", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2.0]}', "hash_ids[1]: expected"),
    ("bool id", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [true]}', "hash_ids[0]: expected"),
    ("negative id", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [3, -1]}', "hash_ids[1]: -1 is outside"),
    ("huge id", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [18446744073709551616]}', "is outside"),
    ("digits", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [' + "9" * 5000 + "]}", "not valid JSON"),
    ("nested", "[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ("not utf-8", b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]} \xff\xfe', "not UTF-8"),
]


@pytest.mark.parametrize("line,expected", [pytest.param(b, e, id=i) for i, b, e in BAD_LINES])
def test_bad_line_is_named_by_file_and_line(tmp_path: Path, line: bytes | str, expected: str) -> None:
    p = write(tmp_path, [req([0, 1]), line, req([0, 2])])
    with pytest.raises(TraceError) as info:
        load_trace(p)
    assert info.value.line == 2 and str(info.value).startswith(f"{p}:2: ")
    assert expected in str(info.value)
    # --skip-bad: skipped, counted, quoted
    t = load_trace(p, skip_bad=True)
    assert t.requests == 2 and t.skipped_count == 1 and t.skipped[0].line == 2


def test_caps_on_line_length_and_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traces, "MAX_LINE_BYTES", 200)
    monkeypatch.setattr(traces, "MAX_BLOCKS_PER_REQUEST", 4)
    long_line = req(list(range(100, 160)))  # about 300 bytes
    p = write(tmp_path, [req([0, 1]), req([0, 1, 2, 3, 4]), long_line, req([0])])
    with pytest.raises(TraceError, match=r":2: hash_ids: 5 ids, more than the 4"):
        load_trace(p)
    t = load_trace(p, skip_bad=True)
    assert t.requests == 2 and t.skipped_count == 2 and t.lines_read == 4
    assert [e.line for e in t.skipped] == [2, 3] and "longer than 200 bytes" in str(t.skipped[1])


def test_empty_and_missing_traces(tmp_path: Path) -> None:
    for lines in ([], ["", "  "]):
        with pytest.raises(TraceError, match="no requests in the trace$"):
            load_trace(write(tmp_path, lines))
    with pytest.raises(TraceError, match=r"no requests in the trace \(2 bad lines skipped\)"):
        load_trace(write(tmp_path, ["{", "[]"]), skip_bad=True)
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path)


def test_cli_reports_a_bad_trace_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, [req([0]), req([0, 1]), '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -4]}'])
    rc, out, err = run_cli(capsys, str(p))
    assert rc == 2 and out == ""
    assert err == f"error: {p}:3: hash_ids[1]: -4 is outside 0..2**63-1\n"
    rc, out, err = run_cli(capsys, str(p), "--skip-bad", "--policies", "lru", "--sizes", "1blocks")
    assert rc == 0 and "warning: skipped 1 bad line" in err and ":3: hash_ids[1]" in err
    rc, out, err = run_cli(capsys, str(write(tmp_path, [], "empty.jsonl")))
    assert rc == 2 and err.startswith("error: ") and "no requests" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--policies", "lru,nosuch"], "unknown eviction policy nosuch; installed: "),
        (["--sizes", "2GiB"], "is a size in bytes: give the size of one block"),
        (["--sizes", "ten"], "--sizes: expected a size like"),
        (["--sizes", "3"], "a share of the distinct blocks is at most 1"),
        (["--sizes", "0%"], "a share must be above 0"),
        (["--block-bytes", "1MiB", "--layers", "2"], "not both"),
        (["--layers", "2"], "needs --kv-heads, --head-dim too"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--config", "x.yaml"], "give the size of one block"),
        (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: cannot write in /nonexistent-dir"),
        (["--sweep", "--plot", "/"], "--plot /: is a folder"),
        (["--plot", "x.png"], "--plot draws the --sweep's curve: give --sweep too"),
    ],
)
def test_cli_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str) -> None:
    p = write(tmp_path, [req([0]), req([0, 1])])
    rc, _, err = run_cli(capsys, str(p), *args)
    assert rc == 2 and err.startswith("error: ") and expected in err, err


def test_a_trace_with_no_prompt_block_or_no_line_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Requests whose hash_ids are all empty: nothing to replay (was a division by zero
    after the replay). A file with no line end (/dev/zero): refused at the first line,
    and read past only so far with --skip-bad (was an endless read)."""
    p = write(tmp_path, ['{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}'] * 3)
    rc, out, err = run_cli(capsys, str(p), "--policies", "lru")
    assert rc == 2 and "no request has a prompt block" in err and "Traceback" not in err, err
    for extra in ([], ["--skip-bad"]):
        rc, _, err = run_cli(capsys, "/dev/zero", "--policies", "lru", *extra)
        assert rc == 2 and err.startswith("error: /dev/zero:1: "), err


def test_sizes() -> None:
    caps = parse_sizes("5%, 0.5,1, 7blocks,2KiB", 1000, 512)
    assert [(c.label, c.blocks) for c in caps] == [("5%", 50), ("0.5", 500), ("1", 1000), ("7blocks", 7), ("2KiB", 4)]
    assert parse_sizes("0.0001", 1000, None)[0].blocks == 1  # at least one block
    assert parse_sizes("1TiB,99999999999blocks", 1000, 512)[0].blocks == 1000  # never more than every distinct block
    for bad, why in (("1.5blocks", "whole number"), ("-3blocks", "whole number"), ("nan%", "above 0"), ("2x", "expected a size")):
        with pytest.raises(ValueError, match=why):
            parse_sizes(bad, 1000, 512)
    with pytest.raises(ValueError, match="less than one block"):
        parse_sizes("100B", 1000, 512)


# -- the engine, by hand ------------------------------------------------------------------
# Capacity 3 blocks, LRU (oldest first):
#   [1,2]    2 misses; cache 1,2
#   [1,2,3]  2 hits, 3 stored; cache 1,2,3
#   [4]      miss; 4 evicts 1; cache 2,3,4
#   [1,2,3]  0 hits: 2 and 3 are resident but their prefix head 1 is gone. 1 evicts 2,
#            then 2 (a miss again) evicts 3, 3 evicts 4; cache 1,2,3
#   [1,2,3]  3 hits
#   [4]      miss; 4 evicts 1
# LRU: 5 hits of 13 blocks, 5 evictions. The optimum keeps 1,2,3 and never admits 4: 8 hits. The
# ceiling is 13 - 4 distinct = 9, which needs 4 blocks (all four live after [4]).
HAND = [[1, 2], [1, 2, 3], [4], [1, 2, 3], [1, 2, 3], [4]]


def test_hand_built_trace_lru_hits(tmp_path: Path) -> None:
    t = load_trace(write(tmp_path, [req(ids) for ids in HAND]))
    keys = chain_keys(t)
    r = replay_engine(t, keys, cpu_config(t, 3, "lru", 512))
    assert (r.hits, r.blocks) == (5, 13)
    assert r.tiers[0].name == "local_cpu" and r.tiers[0].hits == 5 and r.tiers[0].evictions == 5
    assert replay_engine(t, keys, cpu_config(t, 4, "lru", 512)).hits == 9
    assert optimum_hits(t, 3) == 8 and optimum_hits(t, 4) == 9 == ceiling_hits(t)
    assert full_capacity(t) == 4


def test_tail_tokens_follow_input_length(tmp_path: Path) -> None:
    lines = [req([1, 2, 3], input_length=2 * 512 + 100), req([4], input_length=512), req([5, 6], input_length=700), req([7, 8])]
    lines.append(req([9], input_length=2000))  # 1 id for 2000 tokens: not the trace's block size, taken as whole
    t = load_trace(write(tmp_path, lines))
    assert list(tail_tokens(t, 512)) == [100, 0, 188, 412, 0]
    assert list(tail_tokens(t, 256)) == [0, 0, 0, 0, 0]  # every length is off a 256-token grid's last block here


# A prompt's partial tail is stored as a partial chunk, as the default connector stores
# it, and the policy hears it (the next victim: only the same prompt could hit it). A
# small trace where that changes adaptive's hits at capacity 4 (found by a search over
# small traces): (ids, input_length); a length below the ids' 512s ends in a partial block.
TAILS = [([4], 412), ([2, 1], 924), ([3], 512), ([3, 4, 3], 1536), ([4, 3], 924), ([2, 3], 924)]


def test_partial_tails_reach_the_policy(tmp_path: Path) -> None:
    t = load_trace(write(tmp_path, [req(ids, input_length=n) for ids, n in TAILS]))
    keys = chain_keys(t)
    hits = {}
    for policy, tails in itertools.product(("adaptive", "lru"), (True, False)):
        hits[policy, tails] = replay_engine(t, keys, cpu_config(t, 4, policy, 512), partial_tails=tails).hits
    assert hits["adaptive", True] == 3 and hits["adaptive", False] == 2  # the negative control: no hint, one hit fewer
    assert hits["lru", True] == hits["lru", False]  # lru has no use for the hint


# -- the optimum --------------------------------------------------------------------------
def random_trace(rng: random.Random, requests: int, docs: int, doc_len: int, fresh: int) -> list[list[int]]:
    """Requests that share prefixes of a few documents, each with a fresh tail."""
    bodies = [[rng.randrange(1 << 40) for _ in range(doc_len)] for _ in range(docs)]
    out = []
    for _ in range(requests):
        body = bodies[min(int(rng.expovariate(1.0)), docs - 1)]
        out.append(body[: rng.randint(0, doc_len)] + [rng.randrange(1 << 40) for _ in range(rng.randint(0, fresh))])
    return out


def brute_force_optimum(t: traces.Trace, capacity: int) -> int:
    """The most prefix hits of any schedule: after each request, keep any subset of at
    most ``capacity`` of the blocks held or just used (exhaustive search)."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for i in range(t.requests):
        path = list(t.path_of(i))
        nxt: dict[frozenset[int], int] = {}
        for held, score in best.items():
            hit = next((k for k, n in enumerate(path) if n not in held), len(path))
            pool = sorted(held | set(path))
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    s = frozenset(keep)
                    if nxt.get(s, -1) < score + hit:
                        nxt[s] = score + hit
        best = nxt
    return max(best.values())


def test_optimum_is_exact_on_small_traces(tmp_path: Path) -> None:
    rng = random.Random(7)
    checked = 0
    for case in range(60):
        ids = random_trace(rng, requests=8, docs=2, doc_len=3, fresh=1)
        t = load_trace(write(tmp_path, [req(x) for x in ids], f"small{case}.jsonl"))
        if t.distinct_blocks > 8:
            continue
        for capacity in (1, 2, 3):
            hits, stray = optimum_run(t, capacity, next_uses(t))
            assert stray == 0
            assert hits == brute_force_optimum(t, capacity), (ids, capacity)
            checked += 1
    assert checked >= 45


def test_optimum_bounds_every_policy_and_reaches_the_ceiling(tmp_path: Path) -> None:
    rng = random.Random(11)
    t = load_trace(write(tmp_path, [req(x) for x in random_trace(rng, requests=300, docs=12, doc_len=8, fresh=3)]))
    keys, nxt = chain_keys(t), next_uses(t)
    ceiling, full = ceiling_hits(t), full_capacity(t, nxt)
    assert 0 < full < t.distinct_blocks and ceiling > 0
    policies = sorted(cli.PluginManager().eviction_policies())
    assert {"lru", "s3fifo", "tinylfu"} <= set(policies)
    beaten = 0
    for capacity in (max(1, full // 8), full // 3, full - 1):
        opt, stray = optimum_run(t, capacity, nxt)
        assert stray == 0 and opt < ceiling  # negative control: below the full capacity, short of the ceiling
        for p in policies:
            hits = replay_engine(t, keys, cpu_config(t, capacity, p, 512)).hits
            assert hits <= opt, (p, capacity)
            beaten += hits < opt
    assert beaten > 0  # the bound is not vacuous
    assert optimum_hits(t, full, nxt) == ceiling == optimum_hits(t, t.distinct_blocks, nxt)
    assert replay_engine(t, keys, cpu_config(t, t.distinct_blocks, "lru", 512)).hits == ceiling


# -- the command --------------------------------------------------------------------------
def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, [req(ids) for ids in HAND])
    out_json = tmp_path / "r.json"
    rc, out, err = run_cli(
        capsys, str(p), "--policies", "lru,s3fifo", "--sizes", "3blocks,1", "--block-bytes", "1MiB", "--json", str(out_json)
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert "6 requests" in lines[0] and "13 prompt blocks of 512 tokens, 4 distinct (4.0 MiB of KV)" in lines[0]
    assert "69.23% of prompt blocks hit; the optimum reaches it from 100% = 4 blocks = 4.0 MiB" in lines[1]
    header = next(line for line in lines if line.startswith("SIZE"))
    assert header.split() == ["SIZE", "lru", "s3fifo", "OPTIMUM"]
    row3 = next(line for line in lines if line.startswith("75.0% = 3 blocks"))
    assert "38.46% (62%)" in row3 and row3.endswith("61.54%")  # lru 5/13, 5 of the optimum's 8
    data = json.loads(out_json.read_text())
    assert data["trace"]["requests"] == 6 and data["ceiling"]["hits"] == 9 and data["optimum_reaches_ceiling_at_blocks"] == 4
    assert [r["size"]["blocks"] for r in data["rows"]] == [3, 4]
    assert data["rows"][0]["policies"]["lru"]["hits"] == 5 and data["rows"][0]["optimum"]["hits"] == 8
    assert data["rows"][1]["policies"]["lru"]["hits"] == 9


def test_cli_sweep_draws_a_png_and_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(3)
    p = write(tmp_path, [req(x) for x in random_trace(rng, requests=120, docs=6, doc_len=6, fresh=2)])
    png = tmp_path / "sweep.png"
    rc, out, err = run_cli(capsys, str(p), "--sweep", "--policies", "lru,tinylfu", "--plot", str(png), "--block-bytes", "2MiB")
    assert rc == 0, err
    assert "capacity planner" in out and "TARGET" in out and f"plot: {png}" in out
    assert len([line for line in out.splitlines() if line[:1].isdigit() and "blocks" in line]) >= 10
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE == b"\x89PNG\r\n\x1a\n"
    length, tag = struct.unpack(">I4s", data[8:16])
    width, height, depth, color = struct.unpack(">IIBB", data[16:26])
    assert (length, tag, depth, color) == (13, b"IHDR", 8, 2) and width > 100 and height > 100
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29]) & 0xFFFFFFFF
    assert check_png(data) == (width, height)
    assert data.endswith(b"IEND\xaeB`\x82")


def test_cli_config_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lmcache_backend_disk")
    real_dir = tmp_path / "real-cache"
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(
        "backends:\n"
        "  - name: local_cpu\n    max_size: 2MiB\n    eviction: lru\n"
        f"  - name: disk\n    path: {real_dir}\n    max_size: 8MiB\n"
    )
    rng = random.Random(5)
    p = write(tmp_path, [req(x) for x in random_trace(rng, requests=40, docs=4, doc_len=5, fresh=2)])
    out_json = tmp_path / "c.json"
    rc, out, err = run_cli(capsys, str(p), "--config", str(cfg), "--block-bytes", "1MiB", "--json", str(out_json))
    assert rc == 0, err
    assert "local_cpu 2 + disk 8 blocks" in out and "lru: local_cpu" in out
    data = json.loads(out_json.read_text())
    point = data["rows"][0]["policies"]["lru"]
    tiers = {tr["name"]: tr["hits"] for tr in point["tiers"]}
    assert tiers["disk"] > 0 and tiers["local_cpu"] + tiers["disk"] == point["hits"]
    assert point["hits"] <= data["rows"][0]["optimum"]["hits"]
    assert not real_dir.exists()  # the replay wrote to a private directory, never the real cache's
    rc, _, err = run_cli(capsys, str(p), "--config", str(cfg), "--block-bytes", "1MiB", "--sizes", "5%")
    assert rc == 2 and "--sizes and --sweep do not apply" in err
    cfg.write_text("backends:\n  - name: example_dict\n")
    rc, _, err = run_cli(capsys, str(p), "--config", str(cfg), "--block-bytes", "1MiB")
    assert rc == 2 and "backends[0] (example_dict" in err and "only tiers it can hold privately" in err


def test_progress_and_crossing() -> None:
    import io

    buf = io.StringIO()
    pr = Progress(True, buf, every_s=0.0)
    pr.start("lru at 5%", 1000)
    pr.update(250)
    pr.done()
    text = buf.getvalue()
    assert "lru at 5%: 250/1,000 requests (25%)" in text and "ETA" in text
    silent = io.StringIO()
    off = Progress(False, silent, every_s=0.0)
    off.start("x", 10)
    off.update(5)
    off.done()
    assert silent.getvalue() == ""
    curve = [(10.0, 0.2), (20.0, 0.4), (40.0, 0.5)]
    assert [crossing(curve, y) for y in (0.1, 0.3, 0.45)] == pytest.approx([5.0, 15.0, 30.0])
    assert crossing(curve, 0.6) is None


def test_cli_lists_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.__doc__ is not None and "``replay``" in cli.__doc__
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "replay" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["replay", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--sweep" in out and "10%" in out and "5%,10%,25%,50%" in out
