"""Answers stored as a prefill computes them (``connector.save_decode_cache: prefill``).

A chat's next turn is the previous prompt, the previous answer and a new message. The
previous answer's KV (and, for state-space models, the recurrent state after each of
its whole chunks) was computed by decode steps, one token at a time. What decode
computes differs in its last bits from what a prefill of the same tokens computes, so
storing it (``save_decode_cache: true``) gives the next turn hits after which greedy
tokens can part from those of an engine that prefills the whole conversation: state
layers amplify it.

Instead, when a request finishes normally, the state scheduler
(:mod:`lmcache_connector.state_scheduler`) queues an internal request: the request's
tokens up to its last whole chunk, plus one (vLLM computes at least one token). It
hits the prompt's stored chunks, prefills the answer's whole chunks (its steps end on
chunk boundaries) and the connector stores them as any prompt's: prefill-computed,
exactly what a recomputation gives. Its one sampled token goes nowhere (the scheduler
drops its outputs). A request arriving while a settle that stores some of its chunks
is still in flight waits for it (vLLM asks again each step), at most :data:`WAIT_S`
seconds, instead of computing the same tokens beside it. The cost is one prefill of
each answer's whole chunks, spent between turns; at most :data:`MAX_IN_FLIGHT` settles
are queued or running at once.

When settles run is ``connector.settle_when``:

- ``always``: each as its request finishes, beside the requests running then (the next
  turn's hit is there as soon as possible; an answer nobody follows up is computed once
  more for nothing, which costs throughput where most requests are never followed up);
- ``idle``: only while the engine has nothing else to do, as many as one step's token
  budget holds, so a request arriving meanwhile waits for at most about one step. A
  settle longer than one step (a long answer: 120,000 tokens against a 2,048-token
  budget) runs in *pieces* of whole chunks that fit one step, one after the other:
  each piece stores its chunks, and the next one, handed over at the next idle
  moment, loads them and prefills the chunks after them. A piece whose previous
  piece's chunks are not stored yet (a save still in the background) waits at most
  :data:`WAIT_S`; a settle of which not even one chunk fits a step is not run.
  Queued settles wait; a request that needs one before it ran computes those tokens
  itself (the settle is dropped, nothing is computed twice); past
  :data:`MAX_IN_FLIGHT` the oldest queued one is dropped; one whose prompt chunks left
  the cache meanwhile is dropped (it would recompute the whole prompt). Under sustained load settles rarely run: the next turn
  then costs what it costs without them.

This module only keeps the bookkeeping (plans, what is in flight, who waits); the
scheduler side decides what to settle and the state scheduler builds the requests.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from ..layouts.groups import STATE_SCHEDULER
from ..log import get_logger
from ..settings import SAVE_PREFILL, SETTLE_IDLE

log = get_logger(__name__)

#: request ids of settles start with this (never seen by vLLM's front-end)
PREFIX = "lmcache-settle-"
#: the longest a request waits for a settle that stores some of its chunks
WAIT_S = 10.0
#: settles queued or running at once
MAX_IN_FLIGHT = 64
#: vLLM's request statuses of a normal finish (stop token, stop string, max_tokens)
NORMAL_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})
_GAVE_UP = -1.0  # a waiting request's deadline once it stopped waiting


@dataclass(frozen=True)
class SettlePlan:
    """An internal request to run: ``tokens`` (whole chunks plus one token) with the
    cache options of ``source``, the finished vLLM request (its ``kv_transfer_params``,
    cache salt, LoRA, priority and block hasher: the chunk keys must be the same).
    ``prefix``: the hashes of the chunks it should find stored (the prompt's, then
    those earlier pieces of the same answer stored); ``new_tokens``: how many tokens
    it computes; ``stores``: the hashes of the chunks it stores, in order.
    A piece of a settle longer than a step (``settle_when: idle``): ``after``, the
    piece before it (this one runs once that one finished); ``base``: how many of
    ``prefix`` are the prompt's (the rest are earlier pieces')."""

    req_id: str
    tokens: list[int]
    source: Any
    prefix: tuple[bytes, ...] = ()
    new_tokens: int = 0
    stores: tuple[bytes, ...] = ()
    after: str | None = None
    base: int = 0


class Settler:
    """Settles planned, in flight, and the requests waiting for them."""

    def __init__(
        self,
        *,
        when: str = "always",
        wait_s: float = WAIT_S,
        max_in_flight: int = MAX_IN_FLIGHT,
        clock: Callable[[], float] = time.monotonic,
        chunk_size: int | None = None,
    ) -> None:
        self.idle_only = when == SETTLE_IDLE
        self.wait_s = wait_s
        self.max_in_flight = max_in_flight
        self.chunk_size = chunk_size  # tokens per chunk (None: worked out from each plan)
        self._clock = clock
        self._ids = itertools.count(1)
        self._plans: deque[SettlePlan] = deque()  # planned, not yet handed to the scheduler
        self._in_flight: dict[str, frozenset[bytes]] = {}  # settle id -> chunk hashes it stores (queued or running)
        self._waiting: dict[str, float] = {}  # request id -> when it stops waiting
        self._held: dict[str, float] = {}  # queued piece -> when it stops waiting for the previous piece's chunks
        self._pieces: set[str] = set()  # pieces split off a settle, in flight (counted with the settle's last piece)
        # counters (read by tests and the scheduler's stats)
        self.planned = 0
        self.finished = 0
        self.skipped = 0  # not planned: MAX_IN_FLIGHT settles in flight (settle_when: always)
        self.waits = 0  # requests that waited for a settle
        self.gave_up = 0  # requests that stopped waiting after wait_s
        self.superseded = 0  # queued settles dropped: a request needing their chunks came first (idle)
        self.dropped = 0  # queued settles dropped: the oldest past MAX_IN_FLIGHT, or their prompt left the cache (idle)
        self.pieces = 0  # pieces split off settles longer than one step (idle)
        self.too_long = 0  # of the dropped: not even one chunk fits a step (idle)

    def is_settle(self, req_id: str) -> bool:
        return req_id in self._in_flight

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def plan(
        self, source: Any, tokens: list[int], hashes: Iterable[bytes], prefix: Iterable[bytes] = (), new_tokens: int = 0
    ) -> SettlePlan | None:
        """Queue a settle of ``tokens`` that stores the chunks ``hashes`` after finding
        ``prefix`` stored. With :data:`MAX_IN_FLIGHT` in flight already: ``idle`` drops
        the oldest queued one to make room; otherwise (or with none queued) None,
        counted as skipped."""
        if len(self._in_flight) >= self.max_in_flight:
            if not (self.idle_only and self._plans):
                self.skipped += 1
                return None
            self.drop(self._plans.popleft().req_id)
        prefix = tuple(prefix)
        plan = SettlePlan(self._new_id(source), tokens, source, prefix, new_tokens, tuple(hashes), None, len(prefix))
        self._in_flight[plan.req_id] = frozenset(plan.stores)
        self._plans.append(plan)
        self.planned += 1
        return plan

    def _new_id(self, source: Any) -> str:
        return f"{PREFIX}{next(self._ids)}-{getattr(source, 'request_id', '')}"

    def take(
        self, idle: bool = True, budget: int | None = None, stored: Callable[[SettlePlan], int] | None = None
    ) -> list[SettlePlan]:
        """The plans to hand to the scheduler now: ``always``, every plan queued since
        the last call; ``idle``, when the engine is ``idle`` (no request running or
        waiting), the oldest queued ones whose new tokens fit in ``budget`` (one
        step's; all without a budget), else none.

        ``idle`` never hands over more than ``budget``: the first queued settle, when
        longer, is split and only its first piece (the whole chunks that fit, plus the
        one token vLLM computes) is handed over; the rest stays first in the queue and
        is taken (split again if need be) once that piece finished, at an idle moment.
        A settle of which not even one chunk fits is dropped (counted in
        ``too_long``). ``stored(plan)``, when given, says how many of ``plan.prefix``
        are stored: a settle whose prompt chunks left the cache is dropped; a piece
        whose earlier pieces' chunks are not all stored yet waits, first in the
        queue, at most ``wait_s``, then is dropped."""
        if not self.idle_only:
            plans = list(self._plans)
            self._plans.clear()
            return plans
        out: list[SettlePlan] = []
        used = 0
        while idle and self._plans:
            nxt = self._plans[0]
            if nxt.after is not None and nxt.after in self._in_flight:
                break  # the piece before it is still queued in vLLM or running
            if stored is not None:
                ready = self._ready(nxt, stored(nxt))
                if ready is None:
                    break  # waits for the previous piece's chunks to be stored
                if not ready:
                    self._plans.popleft()
                    self.drop(nxt.req_id)
                    continue
            if budget is None or used + nxt.new_tokens <= budget:
                out.append(self._plans.popleft())
                used += nxt.new_tokens
                continue
            if out:
                break
            piece = self._piece(nxt, budget)
            if piece is None:
                self._plans.popleft()
                self.too_long += 1
                self.drop(nxt.req_id)
                continue
            out.append(piece)
            break
        return out

    def _ready(self, plan: SettlePlan, found: int) -> bool | None:
        """Whether ``plan`` can run with ``found`` of its prefix chunks stored: True;
        False, drop it (its prompt left the cache, or the previous piece's chunks
        never came); None, wait (they may still be on their way)."""
        if found >= len(plan.prefix):
            self._held.pop(plan.req_id, None)
            return True
        if plan.after is None or found < plan.base:
            return False
        now = self._clock()
        until = self._held.setdefault(plan.req_id, now + self.wait_s)
        if now < until:
            return None
        del self._held[plan.req_id]
        return False

    def _piece(self, plan: SettlePlan, budget: int) -> SettlePlan | None:
        """Split ``plan`` (first in the queue, longer than ``budget``): the first
        piece, its whole chunks that fit in ``budget`` with the one token vLLM
        computes, is returned; the rest replaces ``plan`` in the queue, to run after
        that piece. None when not even one chunk fits."""
        chunks = len(plan.prefix) + len(plan.stores)
        cs = self.chunk_size or ((len(plan.tokens) - 1) // chunks if chunks else 0)
        k = (budget - 1) // cs if cs > 0 else 0
        if k < 1 or k >= len(plan.stores):
            if self.too_long == 0:
                log.warning(
                    "lmcache-core: settle_when: idle: a chunk (%d tokens) and the token vLLM computes do not fit in one "
                    "step's token budget (%d): such answers are not settled (raise --max-num-batched-tokens, or "
                    "use settle_when: always)",
                    cs,
                    budget,
                )
            return None
        end = len(plan.prefix) + k
        piece = SettlePlan(
            self._new_id(plan.source),
            plan.tokens[: end * cs + 1],
            plan.source,
            plan.prefix,
            k * cs + 1,
            plan.stores[:k],
            plan.after,
            plan.base,
        )
        rest = replace(
            plan,
            prefix=plan.prefix + plan.stores[:k],
            new_tokens=plan.new_tokens - k * cs,
            stores=plan.stores[k:],
            after=piece.req_id,
        )
        self._plans[0] = rest
        self._in_flight[piece.req_id] = frozenset(piece.stores)
        self._in_flight[rest.req_id] = frozenset(rest.stores)
        self._pieces.add(piece.req_id)
        self.pieces += 1
        return piece

    def drop(self, req_id: str) -> None:
        """Settle ``req_id`` (taken) is not run after all: its prompt left the cache,
        or vLLM refused the request. The rest of its answer, queued to run after it,
        goes too (it would find the piece's chunks missing)."""
        self._held.pop(req_id, None)
        piece = req_id in self._pieces
        self._pieces.discard(req_id)
        if self._in_flight.pop(req_id, None) is not None and not piece:
            self.dropped += 1
        for plan in [p for p in self._plans if p.after == req_id]:
            self._plans.remove(plan)
            self.drop(plan.req_id)

    def done(self, req_id: str) -> None:
        """``req_id`` finished (or was never added): a settle leaves the flight, a
        request that waited is forgotten."""
        if self._in_flight.pop(req_id, None) is not None and req_id not in self._pieces:
            self.finished += 1
        self._pieces.discard(req_id)
        self._waiting.pop(req_id, None)

    def must_wait(self, req_id: str, hashes: Iterable[bytes]) -> bool:
        """Whether request ``req_id`` (chunk hashes ``hashes``) should wait for a settle
        in flight that stores one of its chunks: until that settle finishes, at most
        ``wait_s`` from its first wait."""
        if not self._in_flight or req_id in self._in_flight or self._waiting.get(req_id) == _GAVE_UP:
            return False
        mine = set(hashes)
        ahead = [sid for sid, stores in self._in_flight.items() if stores & mine]
        if ahead and self.idle_only and self._plans:
            # queued, not running yet (idle): this request computes those tokens itself
            queued = [p for p in self._plans if p.req_id in ahead]
            for plan in queued:
                self._plans.remove(plan)
                del self._in_flight[plan.req_id]
                self._held.pop(plan.req_id, None)
                self.superseded += 1
            if len(queued) == len(ahead):
                ahead = []
        if not ahead:
            self._waiting.pop(req_id, None)
            return False
        now = self._clock()
        until = self._waiting.get(req_id)
        if until is None:
            self._waiting[req_id] = now + self.wait_s
            self.waits += 1
            return True
        if now < until:
            return True
        self._waiting[req_id] = _GAVE_UP  # counted once, never waits again
        self.gave_up += 1
        return False


def resolve(
    mode: bool | str, *, has_state: bool, state_scheduler: bool, can_load: bool, can_save: bool
) -> tuple[bool, str | None]:
    """Whether settles run for ``connector.save_decode_cache`` = ``mode``, and the
    start-up warning to log (None when nothing is to be said)."""
    if mode == SAVE_PREFILL:
        if not state_scheduler:
            return False, (
                f"connector.save_decode_cache: prefill needs vLLM started with --scheduler-cls {STATE_SCHEDULER} "
                "(it runs the internal requests that store answers): without it answers are not stored, only prompts"
            )
        if not (can_load and can_save):
            return False, (
                "connector.save_decode_cache: prefill needs kv_role kv_both (a settle loads the prompt's chunks and "
                "stores the answer's): answers are not stored, only prompts"
            )
        return True, None
    if mode is True and has_state:
        return False, (
            "connector.save_decode_cache: true stores recurrent states computed by decode steps, which differ in "
            "their last bits from a prefill's: greedy tokens after such a hit can part from a recomputation. "
            f"connector.save_decode_cache: prefill (with --scheduler-cls {STATE_SCHEDULER}) stores answers as a "
            "prefill computes them"
        )
    return False, None
