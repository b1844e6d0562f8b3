"""Request traces in the Mooncake format, read for :mod:`lmcache_core.replay`.

One JSON object a line (JSONL)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3]}

``timestamp`` is milliseconds from the trace's start, ``input_length`` and
``output_length`` are token counts, ``hash_ids`` has one id per block of the prompt
(512 tokens in the published traces). Ids are prefix hashes: two requests share the
KV of their first k blocks exactly when their first k ids are equal. Other keys are
ignored; blank lines are skipped.

:func:`load_trace` turns the prompts into paths in a prefix tree: node ``n`` stands
for one block *and everything before it* (its parent node and that node's block id),
so the k-th block of a request is the same node as another request's k-th block
exactly when their first k ids are equal, whatever the ids themselves look like
(ids need not be globally unique prefix hashes: a trace with per-position ids works
too). That node is what becomes one chunk key of the engine.

Input is untrusted: every line is checked (JSON, each field's type and range, at
most :data:`MAX_LINE_BYTES` bytes and :data:`MAX_BLOCKS_PER_REQUEST` ids) and a bad
one is a :class:`TraceError` naming the file and line, or, with ``skip_bad``, skipped
and counted. Memory is bounded by the line cap while reading; what the trace keeps
is about 16 bytes per block id plus the prefix tree (about 150 bytes a node).
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

#: longest line read (bytes, newline excluded): a line of 65,536 ten-digit ids fits
MAX_LINE_BYTES = 1 << 20
#: an over-long line read past (skipping bad lines) up to this many bytes; more ends the read
MAX_SKIPPED_LINE_BYTES = 64 << 20
#: most block ids one request may have (33.5M tokens at 512 tokens a block)
MAX_BLOCKS_PER_REQUEST = 1 << 16
#: largest ``input_length`` / ``output_length`` taken (tokens)
MAX_TOKENS = 1 << 31
#: largest block id (ids are stored as signed 64-bit integers)
MAX_BLOCK_ID = (1 << 63) - 1
#: default tokens per block of the published Mooncake traces
DEFAULT_BLOCK_TOKENS = 512
#: bad lines quoted in a summary (all of them are counted)
QUOTED_ERRORS = 5

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that cannot be replayed: the file, the line (1-based; ``None`` for the
    file as a whole) and what is wrong."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path, self.line, self.message = path, line, message
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


@dataclass
class Trace:
    """A parsed trace. Request ``i``'s prompt is the node path
    ``flat[offsets[i]:offsets[i + 1]]`` (one node per block, from the first); node
    ``n``'s parent is ``parents[n]`` (-1 for a first block) and its block id
    ``block_ids[n]``. Nodes are numbered in order of first appearance."""

    path: str
    flat: array  # node per block of every request, request after request
    offsets: array  # len(requests) + 1 positions into flat
    parents: array
    block_ids: array
    timestamps: array  # ms, as in the trace
    input_lengths: array
    lines_read: int = 0
    #: bad lines skipped (``skip_bad``): the first :data:`QUOTED_ERRORS` of them
    skipped: list[TraceError] = field(default_factory=list)
    skipped_count: int = 0
    #: requests whose id count is not ``ceil(input_length / block_tokens)``, and the first such line
    length_mismatches: int = 0
    first_mismatch_line: int | None = None

    @property
    def requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def blocks(self) -> int:
        """Prompt blocks of all requests (what a hit ratio divides by)."""
        return len(self.flat)

    @property
    def distinct_blocks(self) -> int:
        """Distinct prefix blocks: what a cache that never evicts ends up holding."""
        return len(self.parents)

    def path_of(self, i: int) -> array:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def max_path(self) -> int:
        """Blocks of the longest prompt."""
        o = self.offsets
        return max((o[i + 1] - o[i] for i in range(len(o) - 1)), default=0)

    def span_ms(self) -> float:
        return float(max(self.timestamps) - min(self.timestamps)) if len(self.timestamps) else 0.0


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_field(obj: dict[str, object], name: str, limit: int) -> int:
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}: expected a whole number, got {_shown(v)}")
    if v < 0:
        raise ValueError(f"{name}: must not be negative, got {v}")
    if v > limit:
        raise ValueError(f"{name}: {v} is larger than {limit}")
    return v


def parse_request(line: bytes) -> tuple[float, int, list[int]]:
    """``(timestamp, input_length, hash_ids)`` of one trace line; ValueError saying
    what is wrong (without the file and line, which the caller adds)."""
    try:
        obj = json.loads(line, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON: {err.msg} at column {err.colno}") from None
    except ValueError as err:  # NaN/Infinity, a number of too many digits
        raise ValueError(f"not valid JSON: {str(err)[:80]}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__ if obj is not None else 'null'}")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise ValueError(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"timestamp: expected a number of milliseconds, got {_shown(ts)}")
    if ts < 0:
        raise ValueError(f"timestamp: must not be negative, got {ts}")
    if ts > 1e15:  # about 31,700 years of milliseconds
        raise ValueError(f"timestamp: {ts} is not a plausible number of milliseconds")
    input_length = _int_field(obj, "input_length", MAX_TOKENS)
    _int_field(obj, "output_length", MAX_TOKENS)
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids: expected a list of block ids, got {_shown(ids)}")
    if len(ids) > MAX_BLOCKS_PER_REQUEST:
        raise ValueError(f"hash_ids: {len(ids)} ids, more than the {MAX_BLOCKS_PER_REQUEST} a request may have")
    for i, v in enumerate(ids):
        if type(v) is not int:  # bool and float are not ids
            raise ValueError(f"hash_ids[{i}]: expected a whole number, got {_shown(v)}")
        if not 0 <= v <= MAX_BLOCK_ID:
            raise ValueError(f"hash_ids[{i}]: {v} is outside 0..2**63-1")
    return float(ts), input_length, ids


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number")


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, bytes)`` per line, newline stripped; ``None`` for a line over
    :data:`MAX_LINE_BYTES` (read past in bounded pieces, never held whole)."""
    n = 0
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            yield n, None  # refused at once, or (skipping bad lines) read past, boundedly:
            skipped = len(line)
            while line and not line.endswith(b"\n"):
                if skipped > MAX_SKIPPED_LINE_BYTES:  # /dev/zero, a binary file: no line ends
                    raise TraceError(
                        str(getattr(f, "name", "trace")),
                        n,
                        f"a line of more than {MAX_SKIPPED_LINE_BYTES >> 20} MiB: not a trace",
                    )
                line = f.readline(MAX_LINE_BYTES)
                skipped += len(line)
            continue
        yield n, line.rstrip(b"\r\n")


def load_trace(
    path: str | Path,
    *,
    limit: int | None = None,
    skip_bad: bool = False,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> Trace:
    """Read a Mooncake-format JSONL trace (at most ``limit`` requests). A bad line is a
    :class:`TraceError` naming the file and line, or with ``skip_bad`` skipped and
    counted; so is an unreadable file and a trace with no request."""
    shown = str(path)
    trace = Trace(shown, array("q"), array("q", [0]), array("q"), array("q"), array("d"), array("q"))
    nodes: dict[tuple[int, int], int] = {}
    try:
        f = open(path, "rb")
    except OSError as err:
        raise TraceError(shown, None, f"cannot open: {err.strerror or err}") from None
    with f:
        try:
            for lineno, (ts, input_length, ids) in _requests(f, trace, limit, skip_bad):
                if len(ids) != math.ceil(input_length / block_tokens):
                    trace.length_mismatches += 1
                    if trace.first_mismatch_line is None:
                        trace.first_mismatch_line = lineno
                _add_path(trace, nodes, ids)
                trace.timestamps.append(ts)
                trace.input_lengths.append(input_length)
        except OSError as err:
            raise TraceError(shown, trace.lines_read or None, f"read failed: {err.strerror or err}") from None
    if trace.requests == 0:
        why = f" ({trace.skipped_count} bad line{'s' if trace.skipped_count != 1 else ''} skipped)" if trace.skipped_count else ""
        raise TraceError(shown, None, f"no requests in the trace{why}")
    return trace


def _requests(f: BinaryIO, trace: Trace, limit: int | None, skip_bad: bool) -> Iterator[tuple[int, tuple[float, int, list[int]]]]:
    """``(line number, parse_request(line))`` for each request line of ``f``, until
    ``trace`` holds ``limit`` requests; ``trace.lines_read`` follows the reading. A bad
    line raises its :class:`TraceError`, or with ``skip_bad`` is counted in ``trace``
    (the first :data:`QUOTED_ERRORS` kept) and passed over; blank lines are skipped."""
    for lineno, line in _lines(f):
        trace.lines_read = lineno
        if limit is not None and trace.requests >= limit:
            return
        try:
            if line is None:
                raise ValueError(f"line is longer than {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            parsed = parse_request(line)
        except ValueError as err:
            bad = TraceError(trace.path, lineno, str(err))
            if not skip_bad:
                raise bad from None
            trace.skipped_count += 1
            if len(trace.skipped) < QUOTED_ERRORS:
                trace.skipped.append(bad)
            continue
        yield lineno, parsed


def _add_path(trace: Trace, nodes: dict[tuple[int, int], int], ids: list[int]) -> None:
    """Append one request's prompt to ``trace``: its path of prefix-tree nodes, a new
    node for each ``(parent, block id)`` not seen before (``nodes`` maps them)."""
    flat, parents, block_ids = trace.flat, trace.parents, trace.block_ids
    parent = -1
    get = nodes.get
    for bid in ids:
        key = (parent, bid)
        node = get(key)
        if node is None:
            node = nodes[key] = len(parents)
            parents.append(parent)
            block_ids.append(bid)
        flat.append(node)
        parent = node
    trace.offsets.append(len(flat))
