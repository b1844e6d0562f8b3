"""``lmcache-core replay``: a request trace through real cache engines, next to the
offline optimum.

Each (eviction policy, capacity) point is a fresh :class:`~lmcache_core.engine.CacheEngine`
with one ``local_cpu`` tier of that capacity and policy (or, with ``--config``, the
tiers of a config file), driven request by request the way the vLLM connector drives
it: look the prompt's chunks up (pinned under the request's id; the hit is the
longest resident prefix), load the hit with ``iter_chunks``, unpin, then store each
chunk after the hit with ``allocate`` + ``store_hashes`` (a prompt's partial last
block with its token count: :func:`tail_tokens`). The hit ratio is prompt blocks
loaded from the cache over prompt blocks.

Blocks become chunk keys through the trace's prefix tree (:mod:`lmcache_core.traces`):
a node's key is a keyed BLAKE2b of its parent's key and its block id, so a request's
k-th key depends on its ids 0..k, as a real chunk key depends on every token before
it. Every block is stored as one small chunk (:data:`SIM_CHUNK_BYTES`, the pool's
alignment): all blocks have the same size, so only counts matter to the policies, and
a capacity is a number of blocks. ``--block-bytes`` (or the model's KV geometry)
converts capacities given in bytes and states the results in bytes; it does not
change what is simulated.

The **optimum** (:func:`optimum_hits`) is Belady's rule on the same trace and
capacity with full knowledge of the future: keep the blocks whose next use is
soonest, evict (or never admit) the one used farthest ahead. A request's blocks are
taken in prompt order, so of a block and its prefix parent, which every request
using the block also uses, the block is evicted first: the cache always holds whole
prefixes, and a block is never kept without its parent (it could not be hit). For
same-sized blocks this is **exactly optimal**: Belady's rule (with the option of not
admitting a block) maximizes hits over all schedules even when a block may hit
without its prefix; the schedule it produces never hits a block after a missed one,
so it meets the prefix rule at no cost, and no prefix-respecting cache can beat it.
It is the optimum of this model (requests one after another, every computed block
offered to the cache, any subset of at most ``capacity`` blocks kept), not of
concurrent serving. The **ceiling** is what a cache that never evicts serves: every
block after its first appearance.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
import json
import logging
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO

import torch

from .config import ConfigError, CoreConfig, LoadedConfig, load_config, parse_size
from .engine import CacheEngine
from .keys import KeyNamespace
from .memory import ALIGN
from .plugins import PluginManager
from .serde import RawCodec, encode
from .traces import DEFAULT_BLOCK_TOKENS, Trace, TraceError, load_trace

#: pool bytes of one simulated block: one float32 vector of the pool's alignment
SIM_CHUNK_BYTES = ALIGN
SIM_SHAPE = (ALIGN // 4,)
SIM_DTYPE = torch.float32
DEFAULT_SIZES = "5%,10%,25%,50%"
SWEEP_SIZES = "0.5%,1%,2%,3%,5%,7.5%,10%,15%,20%,30%,50%,75%,100%"
#: shares of the ceiling the capacity planner answers for
PLANNER_TARGETS = (0.5, 0.75, 0.9, 0.95)
#: tiers a ``--config`` replay can run on its own: memory, and a private temporary directory
CONFIG_TIERS = ("local_cpu", "disk")
KV_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
_KEY = b"lmcache-core/replay/v1"
_ID = struct.Struct("<Q")
_INF = 1 << 62


# -- keys ---------------------------------------------------------------------------------
def chain_keys(trace: Trace) -> list[bytes]:
    """One 16-byte chunk hash per prefix-tree node: ``H(parent's hash || block id)``
    (a keyed BLAKE2b of its own domain, chained from a fixed root), so node ``n``'s
    hash depends on every block id on its path."""
    root = hashlib.blake2b(b"root", digest_size=16, key=_KEY).digest()
    base = hashlib.blake2b(digest_size=16, key=_KEY)
    keys: list[bytes] = []
    append, pack, parents = keys.append, _ID.pack, trace.parents
    for n, bid in enumerate(trace.block_ids):
        p = parents[n]
        h = base.copy()
        h.update(root if p < 0 else keys[p])
        h.update(pack(bid))
        append(h.digest())
    return keys


# -- capacities ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Capacity:
    """A cache size: ``blocks`` (what is simulated) and the text it came from."""

    label: str
    blocks: int


def kv_block_bytes(block_tokens: int, layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """KV bytes of one block: keys and values of every layer."""
    return 2 * layers * kv_heads * head_dim * KV_DTYPES[dtype] * block_tokens


def parse_sizes(text: str, distinct_blocks: int, block_bytes: int | None) -> list[Capacity]:
    """``--sizes``: comma-separated shares of the trace's distinct blocks (``0.1``,
    ``10%``), block counts (``5000blocks``) or byte sizes (``2GiB``, with a known block
    size). ValueError naming the item that does not parse."""
    out: list[Capacity] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        low = item.lower()
        blocks: int
        try:
            if low.endswith("%"):
                share = float(low[:-1]) / 100
                blocks = _share_blocks(share, distinct_blocks, item)
            elif low.endswith(("blocks", "block")):
                number = low[: -6 if low.endswith("blocks") else -5].strip()
                if not number.isdigit():
                    raise ValueError(f"{item!r}: a block count is a whole number")
                blocks = int(number)
            elif low[-1:].isdigit() or low.endswith("."):
                share = float(low)
                if share > 1:
                    raise ValueError(
                        f"{item!r}: a share of the distinct blocks is at most 1 (write {item}blocks for a block count)"
                    )
                blocks = _share_blocks(share, distinct_blocks, item)
            else:
                nbytes = parse_size(item)
                if block_bytes is None:
                    raise ValueError(
                        f"{item!r} is a size in bytes: give the size of one block with --block-bytes or the model's geometry"
                    )
                blocks = nbytes // block_bytes
        except ValueError as err:
            msg = str(err)
            raise ValueError(msg if item in msg else f"{item!r}: {msg}") from None
        if blocks < 1:
            raise ValueError(f"{item!r} is less than one block")
        # a cache of every distinct block never evicts: anything larger is the same
        out.append(Capacity(item, min(blocks, max(distinct_blocks, 1))))
    if not out:
        raise ValueError("no sizes given")
    return out


def _share_blocks(share: float, distinct: int, item: str) -> int:
    if not math.isfinite(share) or share <= 0:
        raise ValueError(f"{item!r}: a share must be above 0")
    return max(1, round(share * distinct))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- progress -----------------------------------------------------------------------------
class Progress:
    """Requests done / total, rate and ETA on stderr every ``every_s`` seconds (a
    terminal only, overwritten in place); silent otherwise."""

    def __init__(self, enabled: bool, out: TextIO | None = None, every_s: float = 2.0) -> None:
        self.out = out if out is not None else sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self._label = ""
        self._total = 0
        self._t0 = self._last = 0.0
        self._shown = False

    def start(self, label: str, total: int) -> None:
        self._label, self._total = label, total
        self._t0 = self._last = time.monotonic()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        rate = done / max(now - self._t0, 1e-9)
        eta = (self._total - done) / rate if rate > 0 else 0.0
        self.out.write(
            f"\r{self._label}: {done:,}/{self._total:,} requests ({100 * done / max(self._total, 1):.0f}%), "
            f"{rate:,.0f}/s, ETA {eta:.0f}s  "
        )
        self.out.flush()
        self._shown = True

    def done(self) -> None:
        if self._shown:
            self.out.write("\r\033[K")
            self.out.flush()
            self._shown = False


# -- the engine ---------------------------------------------------------------------------
@dataclass
class TierResult:
    name: str
    hits: int = 0  # prompt blocks loaded from this tier
    evictions: int = 0
    rejected: int = 0


@dataclass
class PointResult:
    """One engine's replay: blocks loaded (``hits``) of ``blocks`` prompt blocks."""

    policy: str
    capacity_blocks: int
    hits: int
    blocks: int
    seconds: float
    tiers: list[TierResult]
    load_errors: int = 0
    skipped_saves: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


def cpu_config(trace: Trace, blocks: int, policy: str, block_tokens: int) -> CoreConfig:
    """One ``local_cpu`` tier of ``blocks`` blocks evicting with ``policy``."""
    return CoreConfig(
        chunk_size=block_tokens,
        backends=[{"name": "local_cpu", "max_size": blocks * SIM_CHUNK_BYTES, "eviction": policy}],
        staging_size=_staging(trace, 1),
    )


def _staging(trace: Trace, tiers: int) -> int:
    """Pool headroom for the chunks in flight: one request's worth per slower tier
    (their write-behind queues, drained after each request) plus slack."""
    return max(1 << 20, (trace.max_path() + 64) * SIM_CHUNK_BYTES * max(tiers, 1) * 2)


@contextlib.contextmanager
def _engine(config: LoadedConfig, ns: KeyNamespace, plugins: PluginManager | None) -> Iterator[CacheEngine]:
    """A fresh engine; the warnings it logs while starting (about deployment
    settings: a shared tier without a frame secret, a lossy codec) are held back, as
    they concern a real deployment, not a replay's private tiers."""
    logger = logging.getLogger(CacheEngine.__module__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        eng = CacheEngine(config, namespace=ns, plugins=plugins)
    finally:
        logger.setLevel(level)
    with eng:
        yield eng


def replay_engine(
    trace: Trace,
    keys: Sequence[bytes],
    config: CoreConfig | LoadedConfig,
    *,
    label: str = "",
    plugins: PluginManager | None = None,
    progress: Progress | None = None,
    partial_tails: bool = True,
) -> PointResult:
    """Replay ``trace`` through a fresh engine built from ``config``, as the connector
    drives one: per request, ``lookup_runs`` (pinned under the request's id; the same
    call ``lookup_hashes`` makes), ``iter_chunks`` over the hit, ``unpin``, then per
    chunk after the hit ``allocate`` + ``store_hashes``. A prompt's last block when
    its ``input_length`` ends inside it (:func:`tail_tokens`) is stored with its
    token count, as the default connector stores a prompt's tail (its whole engine
    blocks past the last whole chunk, ``sub_chunk_hits``, or the partial chunk
    itself, ``save_unfull_chunk``): a partial chunk, which the engine passes on to
    the policy as such (``hint_partial``); ``partial_tails=False`` stores every
    block as a whole chunk (a model without that hint). With slower tiers the
    write-behind is drained after each request (``flush``): at real request rates it
    keeps up, and a replay runs far faster than real time."""
    loaded_cfg = config if isinstance(config, LoadedConfig) else LoadedConfig(config)
    t0 = time.perf_counter()
    ns = KeyNamespace(model="lmcache-core-replay", layout=f"sim{SIM_CHUNK_BYTES}", dtype=str(SIM_DTYPE))
    if progress is not None:
        progress.start(label, trace.requests)
    with _engine(loaded_cfg, ns, plugins) as eng:
        counts = _Counts([0] * len(eng.tiers))
        tails = tail_tokens(trace, eng.chunk_size) if partial_tails else array("q", bytes(8 * trace.requests))
        shapes = [SIM_SHAPE] * (trace.max_path() + 1)
        for i in range(trace.requests):
            hs = [keys[n] for n in trace.path_of(i)]
            loaded = _load_hit(eng, hs, f"replay-{i}", shapes, counts)
            if not _store_rest(eng, hs, loaded, tails[i]):
                counts.skipped_saves += 1
            if len(eng.tiers) > 1:
                eng.flush()
            if progress is not None and not i & 127:
                progress.update(i)
        stats = eng.stats()
    if progress is not None:
        progress.done()
    tier_stats: list[dict[str, Any]] = stats["tiers"]  # type: ignore[assignment]
    tiers = [
        TierResult(
            str(ts.get("name", level)),
            counts.tier_hits[level],
            int(ts.get("evictions", 0)),
            int((ts.get("extra") or {}).get("rejected", 0)),
        )
        for level, ts in enumerate(tier_stats)
    ]
    capacity = sum(_tier_blocks(s) for s in loaded_cfg.config.backends)
    policy = str(loaded_cfg.config.backends[0].options().get("eviction", "")) or label
    seconds = time.perf_counter() - t0
    return PointResult(policy, capacity, counts.hits, trace.blocks, seconds, tiers, counts.load_errors, counts.skipped_saves)


@dataclass
class _Counts:
    """What a replay counts across requests: hits per tier, in all, load errors, and
    requests whose saves stopped on an exhausted pool."""

    tier_hits: list[int]
    hits: int = 0
    load_errors: int = 0
    skipped_saves: int = 0


def _load_hit(eng: CacheEngine, hs: list[bytes], rid: str, shapes: Sequence[tuple[int, ...]], counts: _Counts) -> int:
    """One request's hit looked up (pinned under ``rid``), read through ``iter_chunks``
    and unpinned, as the connector does; the chunks read counted per tier in
    ``counts``, those that failed recorded as load errors. Returns the chunks read."""
    runs = eng.lookup_runs(hs, pin_id=rid)
    n = sum(c for _, c in runs)
    loaded = 0
    if n:
        chunks = eng.iter_chunks(hs[:n], shapes[:n], SIM_DTYPE)
        try:
            for buf in chunks:
                buf.release()
                loaded += 1
        finally:
            chunks.close()
    eng.pins.release(rid)
    if loaded < n:
        eng.record_load_errors(n - loaded)
        counts.load_errors += n - loaded
    left = loaded
    for level, count in runs:
        take = min(count, left)
        counts.tier_hits[level] += take
        left -= take
    counts.hits += loaded
    return loaded


def _store_rest(eng: CacheEngine, hs: list[bytes], start: int, tail: int) -> bool:
    """Store the chunks of ``hs`` from ``start`` on, the last with ``tail`` tokens when
    ``tail`` (a partial chunk); False when the pool ran out of buffers (chunks in
    flight) and the rest was not stored: a future miss."""
    last = len(hs) - 1
    for j in range(start, len(hs)):
        out = eng.allocate(SIM_SHAPE, SIM_DTYPE)
        if out is None:
            return False
        try:
            eng.store_hashes([hs[j]], [out], n_tokens=tail if j == last and tail else eng.chunk_size)
        finally:
            out.release()
    return True


def tail_tokens(trace: Trace, block_tokens: int) -> array:
    """Per request: the tokens of its last block when ``input_length`` ends inside
    that block (a prompt's partial tail), else 0. A request whose id count is not
    ``ceil(input_length / block_tokens)`` gets 0: its last block is taken as whole."""
    out = array("q", bytes(8 * trace.requests))
    offsets, lengths = trace.offsets, trace.input_lengths
    for i in range(trace.requests):
        n = offsets[i + 1] - offsets[i]
        rest = lengths[i] - (n - 1) * block_tokens
        if n and 0 < rest < block_tokens:
            out[i] = rest
    return out


def _tier_blocks(section: Any) -> int:
    size = section.options().get("max_size")
    return parse_size(size) // SIM_CHUNK_BYTES if size is not None else 0


# -- the optimum --------------------------------------------------------------------------
def next_uses(trace: Trace) -> array:
    """For each position of ``trace.flat``: the index of the next request using the
    same node, or a large sentinel when none does."""
    flat, offsets = trace.flat, trace.offsets
    out = array("q", bytes(8 * len(flat)))
    last = array("q", [_INF]) * trace.distinct_blocks
    for r in range(trace.requests - 1, -1, -1):
        for j in range(offsets[r], offsets[r + 1]):
            node = flat[j]
            out[j] = last[node]
            last[node] = r
    return out


def ceiling_hits(trace: Trace) -> int:
    """Block hits of a cache that never evicts: every block after its first use (a
    block seen before has its whole prefix seen before, so these are prefix hits)."""
    return trace.blocks - trace.distinct_blocks


def full_capacity(trace: Trace, nxt: array | None = None) -> int:
    """The smallest capacity (blocks) at which the optimum reaches the ceiling: the
    most blocks that, between two requests, have been seen and will be used again. A
    cache this large keeps every block until its last use; a smaller one must drop
    one of them while it is still needed."""
    nxt = next_uses(trace) if nxt is None else nxt
    flat, offsets = trace.flat, trace.offsets
    seen = bytearray(trace.distinct_blocks)
    delta = array("q", bytes(8 * trace.requests))  # change of the live count after each request
    for r in range(trace.requests):
        for j in range(offsets[r], offsets[r + 1]):
            node = flat[j]
            if not seen[node]:
                seen[node] = 1
                delta[r] += 1
            if nxt[j] == _INF:
                delta[r] -= 1  # its last use: not needed after this request
    live = peak = 0
    for r in range(trace.requests):
        live += delta[r]
        peak = max(peak, live)
    return peak


def optimum_hits(trace: Trace, capacity: int, nxt: array | None = None, *, progress: Progress | None = None) -> int:
    """Block hits of the offline optimum with ``capacity`` blocks (see the module
    docstring): Belady's rule with a heap of resident blocks by their next use
    (farthest first; of two blocks needed by the same request, the deeper one),
    where a newcomer used later than every resident block is not admitted.
    O(B log B) for B prompt blocks."""
    return optimum_run(trace, capacity, nxt, progress=progress)[0]


def optimum_run(trace: Trace, capacity: int, nxt: array | None = None, *, progress: Progress | None = None) -> tuple[int, int]:
    """:func:`optimum_hits` and the number of resident blocks met after a miss in
    the same request (never counted as hits). The second is 0 by construction: the
    cache only ever holds whole prefixes. Tests check that it stays so."""
    nxt = next_uses(trace) if nxt is None else nxt
    flat, offsets = trace.flat, trace.offsets
    resident = bytearray(trace.distinct_blocks)
    current = array("q", [0]) * trace.distinct_blocks  # next use a resident block's heap entry must show
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, node): the farthest on top
    push, pop = heapq.heappush, heapq.heappop
    size = hits = stray = 0
    if progress is not None:
        progress.start(f"optimum, {capacity:,} blocks", trace.requests)
    for r in range(trace.requests):
        lo, hi = offsets[r], offsets[r + 1]
        run = True
        for j in range(lo, hi):
            node, nu = flat[j], nxt[j]
            if resident[node]:
                if run:
                    hits += 1
                else:
                    stray += 1
                current[node] = nu
                push(heap, (-nu, lo - j, node))
                continue
            run = False
            if nu == _INF or capacity <= 0:
                continue  # never used again: not worth a slot
            if size >= capacity:
                while True:
                    negnu, negdepth, victim = heap[0]
                    if resident[victim] and current[victim] == -negnu:
                        break
                    pop(heap)
                if (nu, j - lo) >= (-negnu, -negdepth):
                    continue  # this block is the one used farthest ahead: not admitted
                pop(heap)
                resident[victim] = 0
                size -= 1
            resident[node] = 1
            current[node] = nu
            size += 1
            push(heap, (-nu, lo - j, node))
        if progress is not None and not r & 1023:
            progress.update(r)
    if progress is not None:
        progress.done()
    return hits, stray


# -- the command --------------------------------------------------------------------------
class ReplayError(ValueError):
    """A request the replay cannot run (arguments, config): an error message, exit 2."""


@dataclass
class Row:
    """One capacity: the optimum there and each engine's replay."""

    capacity: Capacity
    optimum: int
    results: dict[str, PointResult] = field(default_factory=dict)


@dataclass
class Report:
    trace: Trace
    block_tokens: int
    block_bytes: int | None
    ceiling: int
    full: int  # blocks from which the optimum reaches the ceiling
    rows: list[Row]
    policies: list[str]
    config: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``lmcache-core replay``."""
    p.add_argument(
        "trace", help="Mooncake-format JSONL: one request a line with timestamp, input_length, output_length, hash_ids"
    )
    p.add_argument(
        "--policies",
        help="comma-separated eviction policies to compare (default: every installed one, see `lmcache-core plugins`; "
        "with --config: the config's own)",
    )
    p.add_argument(
        "--sizes",
        help="comma-separated cache sizes: shares of the trace's distinct blocks (0.1 or 10%%), block counts (5000blocks) "
        "or bytes (2GiB; needs --block-bytes or the model's geometry). Default "
        + f"{DEFAULT_SIZES}; with --sweep {SWEEP_SIZES}".replace("%", "%%"),
    )
    p.add_argument("--sweep", action="store_true", help="many sizes: draw hit ratio against size as a PNG and plan the capacity")
    p.add_argument("--plot", metavar="PNG", help="where --sweep draws (default: <trace name>.replay.png here)")
    p.add_argument(
        "--config",
        metavar="YAML",
        help="replay through the tiers of this config file (local_cpu, disk: sizes from the file, converted to blocks with "
        "--block-bytes) instead of one local_cpu tier per size",
    )
    p.add_argument(
        "--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, help="tokens per block id of the trace (default 512)"
    )
    p.add_argument(
        "--block-bytes", metavar="SIZE", help="KV bytes of one block (e.g. 40MiB): converts sizes in bytes, and states them"
    )
    g = p.add_argument_group("the model's KV geometry, instead of --block-bytes")
    g.add_argument("--layers", type=int, help="attention layers")
    g.add_argument("--kv-heads", type=int, help="KV heads per layer (per tensor-parallel rank: what one engine stores)")
    g.add_argument("--head-dim", type=int, help="dimension of a head")
    g.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bfloat16", help="KV element type (default bfloat16)")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed lines (counted, the first quoted) instead of stopping")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr (shown only on a terminal anyway)")


def cmd_replay(args: argparse.Namespace, pm: PluginManager | None = None, out: TextIO | None = None) -> int:
    """``lmcache-core replay``: exit 0, or 2 with one ``error:`` line for a bad trace,
    argument or config (never a traceback), 130 when interrupted."""
    out = out if out is not None else sys.stdout
    progress = Progress(not args.quiet and sys.stderr.isatty())
    try:
        report = run(args, pm or PluginManager(), progress)
    except (TraceError, ConfigError, ReplayError) as err:
        progress.done()
        sys.stderr.write(f"error: {err}\n")
        return 2
    except KeyboardInterrupt:
        progress.done()
        sys.stderr.write("interrupted\n")
        return 130
    out.write(format_report(report))
    if args.sweep:
        out.write("\n" + format_planner(report))
        path = Path(args.plot) if args.plot else Path(Path(args.trace).name + ".replay.png")
        try:
            path.write_bytes(plot(report))
        except OSError as err:
            sys.stderr.write(f"error: cannot write the plot {path}: {err.strerror or err}\n")
            return 2
        out.write(f"\nplot: {path}\n")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(to_json(report), indent=1) + "\n")
        except OSError as err:
            sys.stderr.write(f"error: cannot write {args.json}: {err.strerror or err}\n")
            return 2
        out.write(f"results: {args.json}\n")
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Before a replay that may take hours: each file it will write can be written
    (its folder exists and is writable, it is not a folder); ``--plot`` needs ``--sweep``."""
    if args.plot and not args.sweep:
        raise ReplayError("--plot draws the --sweep's curve: give --sweep too")
    outputs = [("--json", args.json)] if args.json else []
    if args.sweep:
        outputs.append(("--plot", args.plot or Path(args.trace).name + ".replay.png"))
    for flag, name in outputs:
        path = Path(name)
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise ReplayError(f"{flag} {name}: is a folder, not a file")
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise ReplayError(f"{flag} {name}: cannot write in {folder} (no such folder, or no permission)")


def _block_bytes(args: argparse.Namespace) -> int | None:
    geometry = (args.layers, args.kv_heads, args.head_dim)
    if args.block_bytes is not None and any(v is not None for v in geometry):
        raise ReplayError("give either --block-bytes or the model's geometry (--layers, --kv-heads, --head-dim), not both")
    if args.block_bytes is not None:
        try:
            n = parse_size(args.block_bytes)
        except ValueError as err:
            raise ReplayError(f"--block-bytes: {err}") from None
        if n <= 0:
            raise ReplayError("--block-bytes must be positive")
        return n
    if all(v is None for v in geometry):
        return None
    names = ("--layers", "--kv-heads", "--head-dim")
    missing = [name for name, v in zip(names, geometry) if v is None]
    if missing:
        raise ReplayError(f"the model's geometry needs {', '.join(missing)} too")
    for name, v in zip(names, geometry):
        if not 0 < v <= 1 << 20:
            raise ReplayError(f"{name} must be between 1 and {1 << 20}, got {v}")
    return kv_block_bytes(args.block_tokens, args.layers, args.kv_heads, args.head_dim, args.kv_dtype)


def _policies(args: argparse.Namespace, pm: PluginManager) -> list[str]:
    installed = sorted(pm.eviction_policies())
    if not args.policies:
        return [] if args.config else installed
    chosen = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    unknown = [p for p in chosen if p not in installed]
    if unknown:
        raise ReplayError(
            f"unknown eviction polic{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; installed: {', '.join(installed)}"
        )
    if not chosen:
        raise ReplayError("--policies: no policy given")
    return chosen


def run(args: argparse.Namespace, pm: PluginManager, progress: Progress | None = None) -> Report:
    """Load the trace, replay every point, compute the optimum: the :class:`Report`."""
    if not 0 < args.block_tokens <= 1 << 20:
        raise ReplayError(f"--block-tokens must be between 1 and {1 << 20}, got {args.block_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ReplayError(f"--limit must be at least 1, got {args.limit}")
    if args.config and (args.sizes or args.sweep):
        raise ReplayError("--config replays the sizes of the config's tiers: --sizes and --sweep do not apply")
    policies = _policies(args, pm)
    block_bytes = _block_bytes(args)
    if args.config and block_bytes is None:
        raise ReplayError(
            "--config: the config's sizes are bytes; give the size of one block (--block-bytes or the model's geometry)"
        )
    _check_outputs(args)
    trace = load_trace(args.trace, limit=args.limit, skip_bad=args.skip_bad, block_tokens=args.block_tokens)
    if trace.blocks == 0:
        raise ReplayError(f"{args.trace}: no request has a prompt block (every hash_ids is empty): nothing to replay")
    if trace.skipped_count:
        first = "; ".join(str(e) for e in trace.skipped)
        sys.stderr.write(f"warning: skipped {trace.skipped_count:,} bad line{'s' if trace.skipped_count > 1 else ''} ({first})\n")
    if trace.length_mismatches:
        sys.stderr.write(
            f"note: {trace.length_mismatches:,} requests have a hash_ids count other than input_length / {args.block_tokens} "
            f"rounded up (first: line {trace.first_mismatch_line}); replayed as given\n"
        )
    keys = chain_keys(trace)
    nxt = next_uses(trace)
    report = Report(trace, args.block_tokens, block_bytes, ceiling_hits(trace), full_capacity(trace, nxt), [], policies)
    if args.config:
        _run_config(args, report, keys, nxt, pm, progress)
        return report
    try:
        capacities = parse_sizes(args.sizes or (SWEEP_SIZES if args.sweep else DEFAULT_SIZES), trace.distinct_blocks, block_bytes)
    except ValueError as err:
        raise ReplayError(f"--sizes: {err}") from None
    capacities = sorted({c.blocks: c for c in capacities}.values(), key=lambda c: c.blocks)
    n_points, k = len(capacities) * len(policies), 0
    for cap in capacities:
        row = Row(cap, optimum_hits(trace, cap.blocks, nxt, progress=progress))
        report.rows.append(row)
        for policy in policies:
            k += 1
            cfg = cpu_config(trace, cap.blocks, policy, args.block_tokens)
            label = f"[{k}/{n_points}] {policy} at {cap.label}"
            row.results[policy] = replay_engine(trace, keys, cfg, label=label, plugins=pm, progress=progress)
    return report


def _run_config(
    args: argparse.Namespace, report: Report, keys: Sequence[bytes], nxt: array, pm: PluginManager, progress: Progress | None
) -> None:
    """``--config``: the config's tiers, each size converted to blocks; once per
    ``--policies`` entry (every ``local_cpu`` tier's ``eviction`` set to it) or once
    as configured. The optimum is for one cache as large as all tiers together."""
    assert report.block_bytes is not None
    trace = report.trace
    report.config = str(args.config)
    runs = report.policies or [""]
    for k, policy in enumerate(runs, start=1):
        tmp = tempfile.mkdtemp(prefix="lmcache-replay-")
        try:
            sections, tiers = _config_sections(args.config, report.block_bytes, policy or None, tmp, pm.config_model())
            overrides = {
                "backends": sections,
                "chunk_size": report.block_tokens,
                "staging_size": _staging(trace, len(sections)),
                "write_queue_size": max(256, trace.max_path() + 1),
            }
            loaded = load_config(
                args.config,
                overrides=overrides,
                overrides_source=f"{args.config}, as lmcache-core replay rewrites it",
                model=pm.config_model(),
            )
            name = policy or str(sections[0].get("eviction", "tinylfu" if sections[0]["name"] == "local_cpu" else "config"))
            if not report.rows:
                total = sum(b for _, b in tiers)
                label = " + ".join(f"{n} {b:,}" for n, b in tiers) + " blocks"
                report.rows.append(Row(Capacity(label, total), optimum_hits(trace, total, nxt)))
            res = replay_engine(trace, keys, loaded, label=f"[{k}/{len(runs)}] {name}", plugins=pm, progress=progress)
            report.rows[0].results[name] = res
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    report.policies = list(report.rows[0].results)


def _config_sections(
    path: str, block_bytes: int, policy: str | None, tmp: str, model: type[CoreConfig]
) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """The config's ``backends:`` rewritten for a replay: sizes in simulated blocks,
    a disk tier in a private temporary directory (never the real cache's: its byte
    budget would evict real chunks) without fsync; ``policy`` for every CPU tier."""
    from .local_cpu import DEFAULT_EVICTION, LocalCpuConfig

    loaded = load_config(path, model=model)
    source = loaded.source_of("backends")
    out: list[dict[str, Any]] = []
    tiers: list[tuple[str, int]] = []
    for i, sec in enumerate(loaded.config.backends):
        where = f"backends[{i}] ({sec.name}, from {source})"
        if sec.name not in CONFIG_TIERS:
            raise ReplayError(f"{where}: a replay runs only tiers it can hold privately ({', '.join(CONFIG_TIERS)})")
        opts = sec.options()
        size = opts.get("max_size", LocalCpuConfig().max_size if sec.name == "local_cpu" else None)
        if size is None:
            raise ReplayError(f"{where}: no max_size to replay; set it in the config")
        try:
            nbytes = parse_size(size)
        except ValueError as err:
            raise ReplayError(f"{where}.max_size: {err}") from None
        blocks = nbytes // block_bytes
        if blocks < 1:
            raise ReplayError(f"{where}: max_size {size} holds no whole block of {fmt_bytes(block_bytes)}")
        section: dict[str, Any] = {**opts, "name": sec.name, "max_size": blocks * SIM_CHUNK_BYTES}
        if sec.serde is not None:
            section["serde"] = sec.serde
        if sec.name == "local_cpu":
            section["eviction"] = policy or opts.get("eviction", DEFAULT_EVICTION)
        if sec.name == "disk":
            section["path"] = os.path.join(tmp, f"tier{i}")
            section["fsync"] = False
            section["max_size"] = blocks * _sim_frame_bytes()  # a file is a frame: header and payload
            if policy:
                section["eviction"] = policy
        out.append(section)
        tiers.append((sec.name, blocks))
    return out, tiers


def _sim_frame_bytes() -> int:
    """Bytes of one simulated block stored as a raw frame (what a disk tier counts)."""
    key = KeyNamespace(model="lmcache-core-replay", layout=f"sim{SIM_CHUNK_BYTES}", dtype=str(SIM_DTYPE)).key(bytes(16))
    return len(encode(key, torch.zeros(SIM_SHAPE, dtype=SIM_DTYPE), RawCodec()))


# -- output -------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _size_text(report: Report, blocks: float) -> str:
    share = 100 * blocks / report.trace.distinct_blocks
    text = f"{share:.2f}%" if share < 1 else f"{share:.1f}%" if share < 100 else f"{share:.0f}%"
    text += f" = {blocks:,.0f} blocks"
    if report.block_bytes is not None:
        text += f" = {fmt_bytes(blocks * report.block_bytes)}"
    return text


def _columns(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in rows)


def format_report(report: Report) -> str:
    """The header, the table (hit ratio per policy and size, its share of the optimum,
    the optimum) and the time per point."""
    t = report.trace
    lines = [
        f"trace {t.path}: {t.requests:,} requests over {t.span_ms() / 60000:.1f} min, {t.blocks:,} prompt blocks "
        f"of {report.block_tokens} tokens, {t.distinct_blocks:,} distinct"
        + (f" ({fmt_bytes(t.distinct_blocks * report.block_bytes)} of KV)" if report.block_bytes else ""),
        f"ceiling (a cache that never evicts): {_pct(report.ceiling / t.blocks)} of prompt blocks hit; "
        f"the optimum reaches it from {_size_text(report, report.full)}",
    ]
    if report.config:
        lines.append(f"tiers of {report.config}, sizes at {fmt_bytes(report.block_bytes or 0)} a block")
    lines.append("")
    header = ["SIZE", *report.policies, "OPTIMUM"]
    table = [header]
    for row in report.rows:
        opt = row.optimum / t.blocks
        cells = [row.capacity.label if report.config else _size_text(report, row.capacity.blocks)]
        for p in report.policies:
            r = row.results[p]
            share = f"{100 * r.hits / row.optimum:.0f}%" if row.optimum else "-"
            cells.append(f"{_pct(r.hit_ratio)} ({share})")
        cells.append(_pct(opt))
        table.append(cells)
    out = "\n".join(lines) + "\n" + _columns(table)
    out += "hit ratio: prompt blocks loaded from the cache / prompt blocks; (x%): share of the optimum's hits at that size\n"
    for row in report.rows:
        for p in report.policies:
            r = row.results[p]
            if len(r.tiers) > 1:
                parts = ", ".join(f"{tr.name} {_pct(tr.hits / r.blocks)} ({tr.evictions:,} evictions)" for tr in r.tiers)
                out += f"  {p}: {parts}\n"
            if r.load_errors or r.skipped_saves:
                out += f"  {p}: {r.load_errors:,} blocks failed to load, {r.skipped_saves:,} saves skipped\n"
    secs = {p: [row.results[p].seconds for row in report.rows] for p in report.policies}
    out += "seconds per replay (mean over sizes): " + ", ".join(f"{p} {sum(s) / len(s):.1f}" for p, s in secs.items()) + "\n"
    return out


def crossing(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The smallest size at which ``curve`` (sorted (size, hit ratio) points, starting
    from (0, 0)) reaches ``target``, interpolated linearly; None if it never does."""
    x0, y0 = 0.0, 0.0
    for x, y in curve:
        if y >= target:
            return x if y == y0 else x0 + (x - x0) * (target - y0) / (y - y0)
        x0, y0 = x, y
    return None


def _optimum_curve(report: Report) -> list[tuple[float, float]]:
    """The optimum's (blocks, hit ratio) at each size, plus the exact point where it
    reaches the ceiling."""
    t = report.trace
    points = {row.capacity.blocks: row.optimum / t.blocks for row in report.rows}
    points[report.full] = report.ceiling / t.blocks
    return sorted((float(b), h) for b, h in points.items() if b > 0)


def planner(report: Report) -> list[dict[str, Any]]:
    """For each target share of the ceiling, the smallest size (blocks) each policy
    and the optimum reach it at: the capacity planner's answers."""
    t = report.trace
    ceiling = report.ceiling / t.blocks
    curves: dict[str, list[tuple[float, float]]] = {
        p: [(float(row.capacity.blocks), row.results[p].hit_ratio) for row in report.rows] for p in report.policies
    }
    curves["optimum"] = _optimum_curve(report)
    out = []
    for target in PLANNER_TARGETS:
        answers: dict[str, float | None] = {name: crossing(c, target * ceiling) for name, c in curves.items()}
        out.append({"target": target, "hit_ratio": target * ceiling, "blocks": answers})
    return out


def format_planner(report: Report) -> str:
    t = report.trace
    if report.ceiling == 0:
        return "capacity planner: nothing to plan, no block of the trace is ever used twice\n"
    plans = planner(report)
    names = [*report.policies, "optimum"]
    lines = [
        f"capacity planner: the smallest cache serving a share of the ceiling ({_pct(report.ceiling / t.blocks)}), "
        "interpolated between the sizes replayed",
    ]
    table = [["TARGET", *(n.upper() for n in names)]]
    for plan in plans:
        cells = [f"{100 * plan['target']:.0f}% ({_pct(plan['hit_ratio'])})"]
        for n in names:
            b = plan["blocks"][n]
            cells.append(_size_text(report, b) if b is not None else "not reached")
        table.append(cells)
    out = "\n".join(lines) + "\n" + _columns(table)
    out += f"100%: the optimum from {_size_text(report, report.full)} (exact)\n"
    if report.block_bytes is None:
        out += "(give --block-bytes or the model's geometry to see the sizes in bytes)\n"
    return out


def plot(report: Report) -> bytes:
    """Hit ratio against size, one curve per policy and the optimum, as a PNG."""
    from .pngplot import BLACK, Chart, Series, line_chart

    t = report.trace
    share = [100 * row.capacity.blocks / t.distinct_blocks for row in report.rows]
    series = [Series(p, [(x, 100 * row.results[p].hit_ratio) for x, row in zip(share, report.rows)]) for p in report.policies]
    top = max(row.capacity.blocks for row in report.rows)
    opt = [(100 * b / t.distinct_blocks, 100 * h) for b, h in _optimum_curve(report) if b <= top]
    series.append(Series("optimum", opt, BLACK, dash=8))
    log_x = len(share) > 1 and min(share) > 0 and max(share) / min(share) >= 10
    chart = Chart(
        title=f"{Path(t.path).name}: hit ratio vs cache size",
        x_label="cache size, % of the trace's distinct blocks" + (" (log scale)" if log_x else ""),
        y_label="hit ratio, % of prompt blocks",
        series=series,
        hlines=[(100 * report.ceiling / t.blocks, f"ceiling (never evicts) {100 * report.ceiling / t.blocks:.1f}%")],
        log_x=log_x,
        x_format="{:g}%",
        y_format="{:g}%",
    )
    return line_chart(chart)


def to_json(report: Report) -> dict[str, Any]:
    t = report.trace
    rows = []
    for row in report.rows:
        rows.append(
            {
                "size": {
                    "label": row.capacity.label,
                    "blocks": row.capacity.blocks,
                    "share": row.capacity.blocks / t.distinct_blocks,
                },
                "optimum": {"hits": row.optimum, "hit_ratio": row.optimum / t.blocks},
                "policies": {
                    p: {
                        "hits": r.hits,
                        "hit_ratio": r.hit_ratio,
                        "share_of_optimum": r.hits / row.optimum if row.optimum else None,
                        "seconds": round(r.seconds, 3),
                        "load_errors": r.load_errors,
                        "skipped_saves": r.skipped_saves,
                        "tiers": [vars(tr) for tr in r.tiers],
                    }
                    for p, r in row.results.items()
                },
            }
        )
    return {
        "trace": {
            "path": t.path,
            "requests": t.requests,
            "prompt_blocks": t.blocks,
            "distinct_blocks": t.distinct_blocks,
            "span_ms": t.span_ms(),
            "skipped_lines": t.skipped_count,
        },
        "block_tokens": report.block_tokens,
        "block_bytes": report.block_bytes,
        "config": report.config,
        "ceiling": {"hits": report.ceiling, "hit_ratio": report.ceiling / t.blocks},
        "optimum_reaches_ceiling_at_blocks": report.full,
        "rows": rows,
        "planner": planner(report) if len(report.rows) > 1 else [],
    }
