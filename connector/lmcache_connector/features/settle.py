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
  budget holds, so a request arriving meanwhile waits for at most about one step.
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
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from lmcache_core.config import SAVE_PREFILL, SETTLE_IDLE

from ..layouts.groups import STATE_SCHEDULER

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
    ``prefix``: the hashes of the chunks it should find stored (the prompt's);
    ``new_tokens``: how many tokens it computes."""

    req_id: str
    tokens: list[int]
    source: Any
    prefix: tuple[bytes, ...] = ()
    new_tokens: int = 0


class Settler:
    """Settles planned, in flight, and the requests waiting for them."""

    def __init__(
        self,
        *,
        when: str = "always",
        wait_s: float = WAIT_S,
        max_in_flight: int = MAX_IN_FLIGHT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_only = when == SETTLE_IDLE
        self.wait_s = wait_s
        self.max_in_flight = max_in_flight
        self._clock = clock
        self._ids = itertools.count(1)
        self._plans: deque[SettlePlan] = deque()  # planned, not yet handed to the scheduler
        self._in_flight: dict[str, frozenset[bytes]] = {}  # settle id -> chunk hashes it stores (queued or running)
        self._waiting: dict[str, float] = {}  # request id -> when it stops waiting
        # counters (read by tests and the scheduler's stats)
        self.planned = 0
        self.finished = 0
        self.skipped = 0  # not planned: MAX_IN_FLIGHT settles in flight (settle_when: always)
        self.waits = 0  # requests that waited for a settle
        self.gave_up = 0  # requests that stopped waiting after wait_s
        self.superseded = 0  # queued settles dropped: a request needing their chunks came first (idle)
        self.dropped = 0  # queued settles dropped: the oldest past MAX_IN_FLIGHT, or their prompt left the cache (idle)

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
        rid = f"{PREFIX}{next(self._ids)}-{getattr(source, 'request_id', '')}"
        plan = SettlePlan(rid, tokens, source, tuple(prefix), new_tokens)
        self._in_flight[plan.req_id] = frozenset(hashes)
        self._plans.append(plan)
        self.planned += 1
        return plan

    def take(self, idle: bool = True, budget: int | None = None) -> list[SettlePlan]:
        """The plans to hand to the scheduler now: ``always``, every plan queued since
        the last call; ``idle``, when the engine is ``idle`` (no request running or
        waiting), the oldest queued ones whose new tokens fit in ``budget`` (one
        step's; at least one, all without a budget), else none."""
        if not self.idle_only:
            plans = list(self._plans)
            self._plans.clear()
            return plans
        out: list[SettlePlan] = []
        used = 0
        while idle and self._plans:
            nxt = self._plans[0]
            if out and budget is not None and used + nxt.new_tokens > budget:
                break
            out.append(self._plans.popleft())
            used += nxt.new_tokens
        return out

    def drop(self, req_id: str) -> None:
        """Settle ``req_id`` (taken) is not run after all: its prompt left the cache,
        or vLLM refused the request."""
        if self._in_flight.pop(req_id, None) is not None:
            self.dropped += 1

    def done(self, req_id: str) -> None:
        """``req_id`` finished (or was never added): a settle leaves the flight, a
        request that waited is forgotten."""
        if self._in_flight.pop(req_id, None) is not None:
            self.finished += 1
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
