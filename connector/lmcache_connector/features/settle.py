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
are queued or running at once (more finished requests are not settled).

This module only keeps the bookkeeping (plans, what is in flight, who waits); the
scheduler side decides what to settle and the state scheduler builds the requests.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from lmcache_core.config import SAVE_PREFILL

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
    cache salt, LoRA, priority and block hasher: the chunk keys must be the same)."""

    req_id: str
    tokens: list[int]
    source: Any


class Settler:
    """Settles planned, in flight, and the requests waiting for them."""

    def __init__(
        self, *, wait_s: float = WAIT_S, max_in_flight: int = MAX_IN_FLIGHT, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.wait_s = wait_s
        self.max_in_flight = max_in_flight
        self._clock = clock
        self._ids = itertools.count(1)
        self._plans: list[SettlePlan] = []
        self._in_flight: dict[str, frozenset[bytes]] = {}  # settle id -> chunk hashes it stores
        self._waiting: dict[str, float] = {}  # request id -> when it stops waiting
        # counters (read by tests and the scheduler's stats)
        self.planned = 0
        self.finished = 0
        self.skipped = 0  # not planned: MAX_IN_FLIGHT settles in flight
        self.waits = 0  # requests that waited for a settle
        self.gave_up = 0  # requests that stopped waiting after wait_s

    def is_settle(self, req_id: str) -> bool:
        return req_id in self._in_flight

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def plan(self, source: Any, tokens: list[int], hashes: Iterable[bytes]) -> SettlePlan | None:
        """Queue a settle of ``tokens`` that stores the chunks ``hashes``; None (and
        counted as skipped) when :data:`MAX_IN_FLIGHT` are in flight already."""
        if len(self._in_flight) >= self.max_in_flight:
            self.skipped += 1
            return None
        plan = SettlePlan(f"{PREFIX}{next(self._ids)}-{getattr(source, 'request_id', '')}", tokens, source)
        self._in_flight[plan.req_id] = frozenset(hashes)
        self._plans.append(plan)
        self.planned += 1
        return plan

    def take(self) -> list[SettlePlan]:
        """The plans queued since the last call (the state scheduler adds them)."""
        plans, self._plans = self._plans, []
        return plans

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
        if not any(stores & mine for stores in self._in_flight.values()):
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
