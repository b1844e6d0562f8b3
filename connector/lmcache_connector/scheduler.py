"""Scheduler side of the connector: decides what to load and what to save.

Per request it keeps the chunk hashes of the prompt (hashed once), the blocks vLLM
gave it, and how many chunks are known to be in the cache (hit or already saved), so
chunked prefill, preemption and decode never save a chunk twice. Lookups go to the
worker(s) over IPC with a timeout that becomes a miss.

One object per mode, chosen once (:func:`make_scheduler`): :class:`DenseScheduler`
for models with one KV-cache group, :class:`GroupedScheduler` for several (sliding
window, hybrid state-space); what they share is :class:`SchedulerSide`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from lmcache_core.canary import sample
from lmcache_core.keys import as_token_array, chain_seed, chunk_hashes, leading_part_keys

from .layouts.groups import GroupPlan, boundary_hash
from .protocol.kv_events import EventTranslator
from .features.load_policy import step_pairs
from .protocol.lookup_ipc import LookupAnswer, LookupClient
from .protocol.metadata import ChunkTransfer, LMCacheConnectorMetadata
from .options import AUTO, ConnectorSettings, RequestOptions, parse_request_options
from .features.access_log import AccessLog
from .features.settle import NORMAL_FINISH, SettlePlan, Settler
from .protocol.stats import DeltaReporter
from .features.subchunks import SubChunkIndex

if TYPE_CHECKING:
    import numpy as np
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

from .log import get_logger

log = get_logger(__name__)

#: the longest a request waits, from its first lookup that found some of its chunks
#: still in a background save (async_saves), for that save: it asks again every step
#: meanwhile, and after this its lookup answers what is stored then
SAVE_WAIT_S = 1.0


_said: set[str] = set()


def _say_once(say: Callable[[str], object], msg: str) -> None:
    """``say(msg)`` the first time this process has ``msg`` to say."""
    if msg not in _said:
        _said.add(msg)
        say(msg)


def mm_extras(mm_features: Sequence[Any] | None, chunk_size: int) -> dict[int, bytes]:
    """Per-chunk bytes from multimodal items: each item's content hash goes into
    every chunk its placeholder tokens touch, so two different images behind the
    same placeholder tokens never share KV."""
    extras: dict[int, bytes] = {}
    for f in mm_features or ():
        ident = f.identifier
        pos = f.mm_position
        if not ident:
            raise ValueError("multimodal item without a content hash")
        length = max(int(pos.length), 1)
        tag = f"{f.modality}:{ident}@{int(pos.offset)}+{length};".encode()
        for c in range(int(pos.offset) // chunk_size, (int(pos.offset) + length - 1) // chunk_size + 1):
            extras[c] = extras.get(c, b"") + tag
    return extras


def request_seed(opts: RequestOptions, cache_salt: str | None, lora_name: str | None) -> bytes:
    tags = {f"tag:{k}": v for k, v in opts.tags.items()}
    if cache_salt:
        tags["vllm:cache_salt"] = cache_salt
    if lora_name:
        tags["vllm:lora"] = lora_name
    return chain_seed(tags)


@dataclass
class _Req:
    req_id: str
    prompt_len: int
    seed: bytes
    extras: dict[int, bytes]
    hashes: list[bytes]  # full chunks of the prompt (extended during decode if saving it)
    partial: bytes | None  # the prompt's trailing partial chunk, when save_unfull_chunk
    save: bool
    opts: RequestOptions
    request: Any = None  # the live vllm Request (for decode tokens)
    block_ids: list[int] = field(default_factory=list)
    saved_full: int = 0  # full chunks known to be cached
    partial_saved: bool = False
    load: ChunkTransfer | None = None
    load_start: int = 0
    load_end: int = 0
    load_failed: bool = False  # never offered a hit again: vLLM recomputes it
    verify: bool | None = None  # canary: decided at the first hit
    verify_below: int = 0  # chunks below this are recomputed and compared, not loaded
    # Chunks hit by this request's lookup while it waits for blocks: vLLM asks again
    # every step until it allocates, and the hit stays pinned meanwhile.
    looked_up: int | None = None
    slow: bool = False  # the looked-up hit needs a tier slower than memory (async_loads: auto)
    load_async: bool = False  # this request's load runs on the workers' load thread
    saves_planned: int = 0  # async_saves: save transfers planned (one per step it saved in)
    # Sub-chunk hits (subchunks.py): the sub-chunk hashes of each prompt chunk (the
    # trailing partial one included), and the stored chunk a lookup found for the
    # chunk after the hit: (that chunk's index, the stored chunk's hash, the token
    # where its matching blocks end, the tokens it holds); the prompt's block tail
    # (its whole blocks past its last whole chunk) to save, and whether it was.
    subs: list[list[bytes]] = field(default_factory=list)
    tail: tuple[int, bytes, int, int] | None = None
    block_tail: tuple[bytes, int] | None = None  # (hash, tokens)
    block_tail_saved: bool = False
    # per whole chunk, the key a block tail of its first blocks but one would have, as
    # another engine saves it (offered where the index knows nothing; DenseScheduler.inner_tokens)
    inner_tails: list[bytes] = field(default_factory=list)
    saving_since: float | None = None  # when a lookup first found some of its chunks still being saved


class SchedulerSide:
    """What every mode shares: per-request state, the lookup (with the canary's
    sampling), the load planned once vLLM allocates, and saves of whole chunks. One
    subclass per mode, chosen once by :func:`make_scheduler`: :class:`DenseScheduler`
    (one KV-cache group) and :class:`GroupedScheduler` (several groups)."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        block_size: int,
        can_load: bool,
        can_save: bool,
        lookup: LookupClient,
        plan: GroupPlan | None = None,
        events: EventTranslator | None = None,
        settle: bool = False,
    ) -> None:
        self.cfg = settings.core
        self.events = events  # KV events for routers: remembers the vLLM block hashes of saved chunks
        self.cs = self.cfg.chunk_size
        self.block_size = block_size
        self.plan = plan
        self.can_load = can_load
        self.can_save = can_save
        self.lookup_client = lookup
        self._reqs: dict[str, _Req] = {}
        self._unpins: list[str] = []
        self._hit_requests = 0  # requests with a hit so far (canary sampling)
        # Loads sent to the workers the step after allocation (run in the background).
        self._pending_loads: list[_Req] = []
        # Modes that load on the workers' load thread report finished loads back
        # (async_loads_reported); the blocks each request in flight is loading into.
        self.async_loads: bool | str = False
        self._loading: dict[str, set[int]] = {}
        # Counters and features a mode may turn on (read by tests and stats).
        self.async_saves = False
        self.held_requests = 0  # finished requests whose blocks vLLM held for background saves
        self.freed_early = 0  # finished requests whose background saves were all done: freed at once
        self.async_load_requests = 0
        self.subs: SubChunkIndex | None = None
        self.tail_hits = 0  # lookups that hit a stored chunk's first blocks after their chunks
        self.save_waits = 0  # requests that waited a step or more for a background save of their chunks
        self.clock = time.monotonic  # for SAVE_WAIT_S (tests set their own)
        # save_decode_cache: prefill (features/settle.py): finished requests' answers
        # prefilled once more by internal requests the state scheduler runs
        self.settler = Settler(when=self.cfg.connector.settle_when, chunk_size=self.cs) if settle else None
        self._reported = DeltaReporter()
        # connector.access_log (features/access_log.py): a replayable trace of the traffic
        conn = self.cfg.connector
        self.access_log = AccessLog(conn.access_log, conn.access_log_max_bytes, self.cs) if conn.access_log else None

    # -- what a mode decides ------------------------------------------------------------
    def _partial_ok(self) -> bool:
        """Whether the prompt's trailing partial chunk is saved and looked up."""
        return False

    def _prepared(self, st: _Req, prompt: Sequence[int]) -> None:
        """A new request's state is built (its chunk hashes known)."""

    def _offers(self, st: _Req, hashes: list[bytes]) -> dict[int, tuple[bytes, int, int]]:
        """Stored chunks to offer with the lookup (sub-chunk hits): none here."""
        return {}

    def _looked_up(self, st: _Req, answer: LookupAnswer, offers: dict[int, tuple[bytes, int, int]]) -> None:
        """The lookup's answer arrived (``st.looked_up`` set)."""

    def _load_async(self, st: _Req) -> bool:
        """Whether this request's load runs in the background (vLLM then waits for
        ``finished_recving`` before scheduling it)."""
        raise NotImplementedError

    def _planned_load(self, st: _Req, load: ChunkTransfer, tables: Sequence[Sequence[int]], start: int, end: int) -> None:
        """``load`` (``st.load``) is planned for tokens ``start..end`` into ``tables``."""
        raise NotImplementedError

    def build_connector_meta(self, so: "SchedulerOutput") -> LMCacheConnectorMetadata:
        """This step's plan (the mode's :meth:`_build_meta`), with the retention hints of
        the requests it loads or saves for."""
        meta = self._build_meta(so)
        for t in (*meta.loads, *meta.saves):
            st = self._reqs.get(t.req_id)
            if st is not None and st.opts.retention is not None:
                meta.retain[t.req_id] = st.opts.retention
        return meta

    def _build_meta(self, so: "SchedulerOutput") -> LMCacheConnectorMetadata:
        raise NotImplementedError

    def saves_progress(self, done: dict[str, int]) -> None:
        """The workers' latest ``SaveProgress``: save transfers done per request (read
        where saves run in the background: :class:`DenseScheduler`)."""

    def _delay_free(self, st: _Req | None) -> bool:
        """``request_finished``'s answer: whether vLLM holds the request's blocks."""
        return False

    # -- request state ------------------------------------------------------------------
    def _new_state(
        self,
        req_id: str,
        prompt: Sequence[int],
        opts: RequestOptions,
        *,
        priority: int,
        cache_salt: str | None,
        lora_name: str | None,
        mm_features: Sequence[Any] | None,
        request: Any = None,
        prompt_embeds: bool = False,
    ) -> _Req:
        if prompt_embeds:
            # Keys name token ids; an embedded position carries one placeholder id
            # whatever its embedding, so two such prompts would share keys, and KV.
            _say_once(log.info, "requests with prompt embeddings are served without the KV cache (keys name tokens)")
            opts = RequestOptions(skip_save=True, skip_load=True, problem="prompt embeddings")
        save = self.can_save and not opts.skip_save
        partial_ok = self._partial_ok()
        if self.cfg.connector.priority_limit is not None and priority > self.cfg.connector.priority_limit:
            save = False
        try:
            extras = mm_extras(mm_features, self.cs)
        except (AttributeError, TypeError, ValueError) as err:
            log.warning("request %s: unusable multimodal metadata (%s); serving it without the KV cache", req_id, err)
            opts = RequestOptions(skip_save=True, skip_load=True, problem=str(err))
            save, extras = False, {}
        seed = request_seed(opts, cache_salt, lora_name)
        hashes = chunk_hashes(prompt, self.cs, seed=seed, extras=extras, include_partial=partial_ok)
        partial = None
        if partial_ok and len(prompt) % self.cs:
            partial = hashes.pop()
        st = _Req(req_id, len(prompt), seed, extras, hashes, partial, save, opts, request)
        self._prepared(st, prompt)
        self._reqs[req_id] = st
        return st

    def _state_for(self, request: "Request") -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            opts = parse_request_options(request.kv_transfer_params, request.request_id)
            st = self._new_state(
                request.request_id,
                request.prompt_token_ids or [],
                opts,
                priority=request.priority,
                cache_salt=request.cache_salt,
                lora_name=request.lora_request.lora_name if request.lora_request else None,
                mm_features=request.mm_features,
                request=request,
                prompt_embeds=getattr(request, "prompt_embeds", None) is not None,
            )
        return st

    def _lookup_hashes(self, st: _Req) -> list[bytes]:
        return st.hashes[: st.prompt_len // self.cs] + ([st.partial] if st.partial else [])

    def _chunk_end(self, st: _Req, chunk: int) -> int:
        """Token index where ``chunk`` ends (the prompt length for the partial one)."""
        if st.partial and chunk == st.prompt_len // self.cs:
            return st.prompt_len
        return (chunk + 1) * self.cs

    # -- vLLM scheduler hooks ---------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state_for(request)
        if st.opts.skip_load or st.load_failed or request.prompt_token_ids is None or not (self.can_load or st.save):
            return 0, False
        hashes = self._lookup_hashes(st)
        if st.looked_up is None and self.settler is not None and self.settler.must_wait(st.req_id, hashes):
            return None, False  # a settle in flight stores some of its chunks: vLLM asks again next step
        if st.looked_up is None:
            # A producer looks up too (without pinning), so it never re-saves what is cached.
            offers = self._offers(st, hashes) if self.can_load else {}
            alts = {c: offer[0] for c, offer in offers.items()} or None
            pin = st.req_id if self.can_load else None
            answer = self.lookup_client.lookup(hashes, pin, alts) if alts else self.lookup_client.lookup(hashes, pin)
            if answer.saving and self.can_load and self._wait_for_saving(st):
                return None, False  # its chunks are still being saved: vLLM asks again next step
            st.looked_up = answer.chunks
            st.slow = answer.slow
            self._looked_up(st, answer, offers)
        n = st.looked_up or 0
        full = st.prompt_len // self.cs
        if n > full:
            st.partial_saved = True
        hit = st.tail[2] if st.tail else (self._chunk_end(st, n - 1) if n else 0)
        if n and self.can_load and st.save and self._verify_hit(st, hashes[n - 1], min(n, full)):
            return 0, False  # canary: vLLM recomputes the hit, the worker compares it when saving
        st.saved_full = max(st.saved_full, min(n, full))
        if not self.can_load:
            return 0, False
        # vLLM must compute at least the last prompt token to produce logits.
        hit = min(hit, st.prompt_len - 1)
        ext = hit - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.load_start, st.load_end = num_computed_tokens, hit
        return ext, self._load_async(st)

    def _wait_for_saving(self, st: _Req) -> bool:
        """The lookup found some of ``st``'s chunks still in a background save (the
        worker waited :data:`~.transfers.async_saves.LOOKUP_WAIT_S` for it): whether the
        request waits for it a step longer, at most :data:`SAVE_WAIT_S` from its first
        such lookup. Meanwhile it holds what the lookup pinned (the next lookup under
        its id replaces those pins, its end releases them) and vLLM schedules others."""
        now = self.clock()
        if st.saving_since is None:
            st.saving_since = now
            if SAVE_WAIT_S > 0:  # it waits: counted once, at its first such lookup
                self.save_waits += 1
        return now - st.saving_since < SAVE_WAIT_S

    def _verify_hit(self, st: _Req, last_hit: bytes, n_full: int) -> bool:
        """Whether this request's hit of ``n_full`` full chunks is recomputed and
        compared (decided once per request: ``lmcache.verify``, else sampled)."""
        if st.verify is None:
            self._hit_requests += 1
            forced = st.opts.verify
            st.verify = forced if forced is not None else sample(self.cfg.verify_fraction, last_hit, self._hit_requests)
        if not st.verify or not n_full:
            return False
        st.verify_below = max(st.verify_below, n_full)
        self._unpins.append(st.req_id)
        return True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None:
            st.looked_up = None  # allocated: a later ask (after preemption) looks up afresh
        if st is None or num_external_tokens <= 0:
            return
        tables = blocks.get_block_ids()
        start = st.load_start
        end = start + num_external_tokens
        c0, c1 = start // self.cs, -(-end // self.cs)
        hashes = self._lookup_hashes(st)[c0:c1]
        ends = [self._chunk_end(st, c) for c in range(c0, c0 + len(hashes))]
        st.load = ChunkTransfer(st.req_id, hashes, c0, ends, list(tables[0]), write_from=start)
        self._planned_load(st, st.load, tables, start, end)

    def _emit_load(self, st: _Req, meta: LMCacheConnectorMetadata) -> None:
        if st.load is not None:
            meta.loads.append(st.load)
            st.load = None

    def _emit_pending_loads(self, meta: LMCacheConnectorMetadata) -> None:
        """Background loads go out the step after their allocation."""
        for pending in self._pending_loads:
            self._emit_load(pending, meta)
        self._pending_loads = []

    @staticmethod
    def _scheduled(so: "SchedulerOutput") -> list[tuple[str, int, int]]:
        """(request id, tokens computed before this step, tokens scheduled in it) for
        every request the step runs, new and cached."""
        out = [(new.req_id, new.num_computed_tokens, so.num_scheduled_tokens.get(new.req_id, 0)) for new in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        out += [(rid, c, so.num_scheduled_tokens.get(rid, 0)) for rid, c in zip(cached.req_ids, cached.num_computed_tokens)]
        return out

    def _step_work(self, so: "SchedulerOutput", meta: LMCacheConnectorMetadata) -> None:
        """Tokens and attention pairs this step computes (the worker times the step)."""
        try:
            sched = [(done, n) for _, done, n in self._scheduled(so)]
            meta.step_tokens = int(sum(n for _, n in sched))
            meta.step_pairs = step_pairs(sched)
        except (AttributeError, TypeError) as err:  # a cost model input, never worth failing a step
            log.debug("step work not available: %s", err)

    def _savable(self, st: _Req, computed: int) -> tuple[int, int]:
        """(tokens that may be saved, full chunks among them whose hashes are known),
        hashing decode-phase chunks as they complete."""
        limit = computed if self.cfg.connector.save_decode_cache is True else min(computed, st.prompt_len)
        n_full = limit // self.cs
        if n_full > len(st.hashes):
            self._extend_hashes(st, n_full)
            n_full = min(n_full, len(st.hashes))
        return limit, n_full

    def _extend_hashes(self, st: _Req, n_full: int) -> None:
        """Hash decode-phase chunks (tokens beyond the prompt) as they complete."""
        if st.request is None:
            return
        tokens = list(st.request.all_token_ids[: n_full * self.cs])
        start = st.hashes[-1] if st.hashes else None
        more = chunk_hashes(
            tokens,
            self.cs,
            seed=st.seed,
            extras=st.extras,
            start=start,
            first_chunk=len(st.hashes),
        )
        st.hashes.extend(more)

    def loads_failed(self, req_ids: Sequence[str]) -> None:
        """Workers reported these asynchronous loads as failed: vLLM resets the request
        and asks again; it must then recompute, not retry the same objects."""
        for rid in req_ids:
            st = self._reqs.get(rid)
            if st is not None:
                st.load_failed = True
                log.warning("request %s: loading its cached KV failed; recomputing it", rid)

    def async_loads_reported(self, finished: set[str] | None, invalid_blocks: set[int] | None) -> None:
        """The workers' step output for background loads (``async_loads``): a request
        whose blocks failed to load is never offered a hit again (vLLM recomputes the
        failed part, or the whole request if nothing loaded); one reported finished
        is no longer in flight."""
        if invalid_blocks:
            for rid, blocks in self._loading.items():
                st = self._reqs.get(rid)
                if st is not None and blocks & invalid_blocks:
                    st.load_failed = True
                    log.warning("request %s: loading its cached KV failed; recomputing the rest", rid)
        for rid in finished or ():
            self._loading.pop(rid, None)

    def request_finished(self, request: "Request", block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        """Synchronous saves complete within the step that computed them: blocks are
        held only for background saves (``async_saves``). (vLLM itself holds the blocks
        of a request aborted while its asynchronous load is in flight, until the load is
        reported finished.)"""
        self._loading.pop(request.request_id, None)
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st in self._pending_loads:
            self._pending_loads.remove(st)
        self._unpins.append(request.request_id)
        was_settle = False
        if self.settler is not None:
            was_settle = self.settler.is_settle(request.request_id)
            self.settler.done(request.request_id)
            if st is not None and not was_settle:  # a settle is never settled again
                self._plan_settle(st, request)
        if self.access_log is not None and st is not None and not was_settle:
            self._log_access(st, request)
        return self._delay_free(st), None

    def _log_access(self, st: _Req, request: "Request") -> None:
        try:
            arrival = float(request.arrival_time)
            output = int(getattr(request, "num_output_tokens", 0) or 0)
        except (AttributeError, TypeError, ValueError):
            return
        assert self.access_log is not None
        try:
            self.access_log.record(arrival, st.prompt_len, output, st.hashes[: st.prompt_len // self.cs])
        except OSError as err:  # a full disk never fails a request
            log.warning("connector.access_log: %s; recording stops", err)
            self.access_log.close()

    # -- save_decode_cache: prefill (features/settle.py) --------------------------------
    def _plan_settle(self, st: _Req, request: "Request") -> None:
        """A request that finished normally with whole chunks beyond those known
        stored (its answer's): queue an internal request that prefills them."""
        assert self.settler is not None
        if not (st.save and self.can_load) or st.opts.skip_load:
            return
        if getattr(request.status, "name", None) not in NORMAL_FINISH:
            return  # aborted, failed: its client has gone
        if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None or request.mm_features:
            return  # its tokens alone do not say what was computed
        end = int(request.num_computed_tokens) // self.cs
        if end <= st.saved_full:
            return
        self._extend_hashes(st, end)
        if len(st.hashes) < end:
            return
        tokens = list(request.all_token_ids[: end * self.cs + 1])
        prefix = st.hashes[: st.saved_full]
        self.settler.plan(request, tokens, st.hashes[st.saved_full : end], prefix, len(tokens) - len(prefix) * self.cs)

    def take_settles(self, idle: bool = True, budget: int | None = None) -> list[SettlePlan]:
        """Settles to run now (the state scheduler adds them to vLLM's waiting queue);
        ``idle``: whether the engine has no request running or waiting; ``budget``:
        the tokens one step schedules (``settle_when: idle`` hands over what fits, a
        longer settle in step-sized pieces, see :meth:`Settler.take`). A settle
        queued until the engine was idle (``settle_when: idle``) runs only if its
        prompt's chunks are still stored: without them it would recompute the whole
        prompt (looked up without a pin)."""
        if self.settler is None:
            return []
        return self.settler.take(idle, budget, self._settle_prefix_stored)

    def _settle_prefix_stored(self, plan: SettlePlan) -> int:
        """How many of ``plan.prefix`` (the chunks a settle loads) are stored."""
        return self.lookup_client.lookup(list(plan.prefix), None).chunks if plan.prefix else 0

    def take_stats_delta(self) -> dict[str, float]:
        """The scheduler side's counters' increments since the previous call (vLLM's
        ``/metrics``, through the scheduler's connector stats): waits for background
        saves, and the settles'."""
        now: dict[str, float] = {"save_waits": self.save_waits}
        s = self.settler
        if s is not None:
            now.update(
                settles=s.finished,
                settles_superseded=s.superseded,
                settles_dropped=s.dropped + s.skipped,
                settle_waits=s.waits,
            )
        return self._reported.delta(now)

    def settle_dropped(self, req_id: str) -> None:
        """The state scheduler could not add settle ``req_id``: nobody waits for it."""
        if self.settler is not None:
            self.settler.drop(req_id)

    def close(self) -> None:
        self.lookup_client.close()
        if self.access_log is not None:
            self.access_log.close()


class DenseScheduler(SchedulerSide):
    """One KV-cache group: loads before the forward pass or on the workers' load
    thread (``async_loads``), saves in the step or in the background
    (``async_saves``), the prompt's partial chunk (``save_unfull_chunk``) and
    sub-chunk hits (``sub_chunk_hits``, subchunks.py)."""

    def __init__(self, settings: ConnectorSettings, **kw: Any) -> None:
        super().__init__(settings, **kw)
        # Saves run in the background on the workers (see async_saves.py).
        self.async_saves = settings.async_saves
        # async_saves: save transfers the workers reported done, per request (SaveProgress),
        # and finished requests freed at once, named in the next step's metadata
        self._save_progress: dict[str, int] = {}
        self._freed_early: list[str] = []
        # Loads on the workers' load thread (see async_loads.py): every hit (true) or
        # the hits a slower tier than memory serves (auto).
        self.async_loads = settings.async_loads
        subs = SubChunkIndex(self.cs, self.block_size) if self.cfg.connector.sub_chunk_hits else None
        self.subs = subs if subs is not None and subs.useful else None
        #: the tokens of the block tails offered by key inside whole chunks (_inner_tails)
        self.inner_tokens = (self.cs // self.block_size - 1) * self.block_size

    def _partial_ok(self) -> bool:
        return self.cfg.connector.save_unfull_chunk

    # -- sub-chunk hits (subchunks.py) --------------------------------------------------
    def _prepared(self, st: _Req, prompt: Sequence[int]) -> None:
        if self.subs is None or not (st.save or (self.can_load and not st.opts.skip_load)):
            return
        arr = as_token_array(prompt)  # converted once, sliced below without copies
        st.subs = self._sub_hashes(arr, st.seed, st.hashes, st.extras)
        full, rest = divmod(st.prompt_len, self.cs)
        whole = rest // self.block_size * self.block_size
        if whole and not st.partial:
            # the prompt's last whole blocks past its last whole chunk: saved as a
            # partial chunk of their own, so a prompt sharing them hits them (and
            # looked up as such: another engine's saved tail of the same blocks)
            start = st.hashes[full - 1] if full else st.seed
            cut = arr[: full * self.cs + whole]
            h = chunk_hashes(cut, self.cs, seed=st.seed, extras=st.extras, include_partial=True, start=start, first_chunk=full)
            st.block_tail = (h[-1], whole)
        if self.can_load and not st.opts.skip_load:
            st.inner_tails = self._inner_tails(arr, st, full)

    def _inner_tails(self, arr: "np.ndarray", st: _Req, full: int) -> list[bytes]:
        """For each whole chunk of the prompt, the key of a block tail made of its first
        blocks but one, as a prompt that ended inside that chunk saved it (chained from
        the chunk before, so it names everything before too). The index learns block
        tails only from what this scheduler saved or loaded; these find one that another
        engine saved, or this one before a restart, when the request's hit ends at that
        chunk. One key a chunk: with two blocks a chunk (CPU) every block tail; with
        more, the longest only."""
        return leading_part_keys(arr, self.cs, st.hashes[:full], self.inner_tokens, seed=st.seed, extras=st.extras)

    def _sub_hashes(self, arr: "np.ndarray", seed: bytes, hashes: list[bytes], extras: dict[int, bytes]) -> list[list[bytes]]:
        """Per prompt chunk (the trailing partial one too), the sub-chunk hashes of its
        first blocks (``arr``: the prompt as :func:`as_token_array` gives it)."""
        assert self.subs is not None
        cs = self.cs
        out = []
        for c in range(-(-arr.size // cs)):
            prev = hashes[c - 1] if c else seed
            whole = (c + 1) * cs <= arr.size
            out.append(self.subs.prefixes(prev, arr[c * cs : (c + 1) * cs], extras.get(c, b""), whole=whole))
        return out

    def _offers(self, st: _Req, hashes: list[bytes]) -> dict[int, tuple[bytes, int, int]]:
        """Stored chunks (with the tokens they share) that start with the first blocks
        of the request's chunks, where the index knows one."""
        if self.subs is None or not st.subs:
            return {}
        offers = {}
        if len(self.subs):
            for c, prefixes in enumerate(st.subs[: len(hashes) + 1]):
                got = self.subs.candidate(prefixes, hashes[c] if c < len(hashes) else None)
                if got is not None:
                    offers[c] = got
        full = st.prompt_len // self.cs
        if st.block_tail is not None and full not in offers and len(hashes) == full:
            # No index entry (e.g. a fresh engine on a shared store): the request's own
            # block tail, as another engine would have saved it for the same prompt start.
            h, whole = st.block_tail
            offers[full] = (h, whole, whole)
        tokens = self.inner_tokens
        for c, h in enumerate(st.inner_tails):
            if c not in offers:  # no index entry: a block tail another engine saved there
                offers[c] = (h, tokens, tokens)
        return offers

    def _looked_up(self, st: _Req, answer: LookupAnswer, offers: dict[int, tuple[bytes, int, int]]) -> None:
        st.tail = None
        n = st.looked_up or 0
        if answer.tail and n in offers:
            stored, tokens, held = offers[n]
            st.tail = (n, stored, n * self.cs + tokens, held)
            self.tail_hits += 1
            if st.block_tail is not None and stored == st.block_tail[0]:
                st.block_tail_saved = True  # its own block tail is what it hit
            if n < len(st.inner_tails) and st.inner_tails[n] == stored:  # found by its key: the index learns it
                self._remember_tail(st, n, stored, held)
        self._remember_chunks(st, range(min(n, st.prompt_len // self.cs)))

    def _remember_tail(self, st: _Req, chunk: int, h: bytes, tokens: int) -> None:
        """The prompt's partial chunk ``chunk`` is stored as ``h`` (``tokens`` tokens):
        index its whole blocks."""
        if self.subs is not None and chunk < len(st.subs):
            self.subs.remember(st.subs[chunk][: tokens // self.block_size], h, tokens)

    def _remember_chunks(self, st: _Req, chunks: range) -> None:
        """Chunks of the prompt that are stored (saved or hit): index their first blocks."""
        if self.subs is None:
            return
        for c in chunks:
            if c < len(st.subs) and (c + 1) * self.cs <= st.prompt_len:
                self.subs.remember(st.subs[c], st.hashes[c])

    # -- loads --------------------------------------------------------------------------
    def _load_async(self, st: _Req) -> bool:
        st.load_async = self.async_loads is True or (self.async_loads == AUTO and st.slow)
        return st.load_async

    def _planned_load(self, st: _Req, load: ChunkTransfer, tables: Sequence[Sequence[int]], start: int, end: int) -> None:
        c0, c1 = start // self.cs, -(-end // self.cs)
        if st.tail is not None and c1 - 1 == st.tail[0]:
            # a sub-chunk hit: the stored chunk is read whole, its first blocks written
            _, stored, tail_end, held = st.tail
            load.hashes[c1 - 1 - c0 :] = [stored]
            load.chunk_ends[c1 - 1 - c0 :] = [tail_end]
            load.tail_tokens = held
        if st.load_async:
            load.async_load = True
            bs = self.block_size
            self._loading[st.req_id] = set(load.block_ids[start // bs : -(-end // bs)])
            self.async_load_requests += 1
            self._pending_loads.append(st)

    # -- each step ----------------------------------------------------------------------
    def _build_meta(self, so: "SchedulerOutput") -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata(chunk_size=self.cs)
        self._step_work(so, meta)
        self._emit_pending_loads(meta)  # async_loads: sent the step after allocation
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._emit_load(st, meta)
            self._plan_save(st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(nb[0]) if nb else []
            elif nb:
                st.block_ids.extend(nb[0])
            self._emit_load(st, meta)
            self._plan_save(st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0), meta)
        meta.unpins, self._unpins = self._unpins, []
        if self.async_saves:
            self._track_async_saves(so, meta)
            meta.freed_early, self._freed_early = self._freed_early, []
        return meta

    def _plan_save(self, st: _Req, computed: int, meta: LMCacheConnectorMetadata) -> None:
        if not st.save:
            return
        limit, n_full = self._savable(st, computed)
        transfers: list[tuple[int, bytes, int]] = []  # (chunk, hash, end)
        for c in range(st.saved_full, n_full):
            transfers.append((c, st.hashes[c], (c + 1) * self.cs))
        # The prompt's partial chunk (or its block tail), once the whole prompt is computed.
        tail: tuple[bytes, int] | None = None  # (hash, tokens past the last whole chunk)
        partial = False  # the tail is the partial chunk (else the block tail)
        if limit >= st.prompt_len and n_full == st.prompt_len // self.cs:
            if st.partial and not st.partial_saved:
                tail, partial = (st.partial, st.prompt_len % self.cs), True
            elif st.block_tail and not st.block_tail_saved:
                tail = st.block_tail
        if tail is not None:
            transfers.append((n_full, tail[0], n_full * self.cs + tail[1]))
        if not transfers:
            return
        need_blocks = -(-transfers[-1][2] // self.block_size)
        if need_blocks > len(st.block_ids):
            # nothing is marked saved or indexed: a later step may still save them
            log.warning("request %s: %d blocks known, %d needed to save; skipping", st.req_id, len(st.block_ids), need_blocks)
            return
        self._remember_chunks(st, range(st.saved_full, n_full))
        if tail is not None:
            if partial:
                st.partial_saved = True
            else:
                st.block_tail_saved = True
            self._remember_tail(st, n_full, tail[0], tail[1])
        first = transfers[0][0]
        if self.events is not None and st.request is not None:
            for c, h, end in transfers:
                self.events.remember(st.request, c, h, end)
        meta.saves.append(
            ChunkTransfer(
                st.req_id,
                [h for _, h, _ in transfers],
                first,
                [e for _, _, e in transfers],
                list(st.block_ids),
                verify_below=st.verify_below,
            )
        )
        st.saved_full = max(st.saved_full, n_full)

    # -- asynchronous saves (async_saves: true) -----------------------------------------
    def _track_async_saves(self, so: "SchedulerOutput", meta: LMCacheConnectorMetadata) -> None:
        """Remember which requests have saves in the background (their blocks are held
        at finish), and make the workers finish them before this step writes blocks a
        preempted request just gave back."""
        for t in meta.saves:
            st = self._reqs.get(t.req_id)
            if st is not None:
                st.saves_planned += 1
        for rid in getattr(so, "preempted_req_ids", None) or ():
            st = self._reqs.get(rid)
            if st is not None and st.saves_planned:
                meta.drain_saves = True

    def _delay_free(self, st: _Req | None) -> bool:
        """Hold the blocks until the workers report the request's background saves
        done (``finished_sending``), unless they reported all of them done already
        (``SaveProgress``): then vLLM frees them now and the workers are told not to
        report the request."""
        if not (self.async_saves and st is not None and st.saves_planned):
            return False
        if self._save_progress.get(st.req_id, 0) >= st.saves_planned:
            self._freed_early.append(st.req_id)
            self.freed_early += 1
            return False
        self.held_requests += 1
        return True

    def saves_progress(self, done: dict[str, int]) -> None:
        """The workers' latest ``SaveProgress``: save transfers done per request."""
        self._save_progress = done


class GroupedScheduler(SchedulerSide):
    """Several KV-cache groups (sliding-window and hybrid state-space models): every
    group's block table, boundary objects (window pages, recurrent states) saved and
    loaded with the chunks, and loads reported asynchronously (vLLM can only fail a
    multi-group load per request). Whole chunks only."""

    def _lookup_hashes(self, st: _Req) -> list[bytes]:
        assert self.plan is not None
        if self.plan.has_state:
            # A recurrent state restores exactly its boundary: the hit must leave at
            # least the last prompt token to compute, so it ends before the prompt does.
            return st.hashes[: (st.prompt_len - 1) // self.cs]
        return super()._lookup_hashes(st)

    def _load_async(self, st: _Req) -> bool:
        return True

    def _planned_load(self, st: _Req, load: ChunkTransfer, tables: Sequence[Sequence[int]], start: int, end: int) -> None:
        assert self.plan is not None
        load.group_block_ids = tuple(list(t) for t in tables)
        load.async_load = True
        if self.plan.has_boundary and load.hashes:
            load.boundaries = [(boundary_hash(load.hashes[-1]), -(-end // self.cs) * self.cs)]
        self._pending_loads.append(st)

    def _build_meta(self, so: "SchedulerOutput") -> LMCacheConnectorMetadata:
        """Loads are asynchronous (issued the step after allocation, whether or not
        the request runs); saves read every group's current block table from vLLM."""
        meta = LMCacheConnectorMetadata(chunk_size=self.cs)
        self._step_work(so, meta)
        self._emit_pending_loads(meta)
        block_state = getattr(so, "kv_connector_block_state", None)
        for rid, done, n in self._scheduled(so):
            st = self._reqs.get(rid)
            if st is None or not st.save:
                continue
            tables = block_state.get_block_ids(rid) if block_state is not None else None
            if tables is None:
                log.warning("request %s: vLLM gave no block tables this step; not saving it", rid)
                st.save = False
                continue
            self._plan_save(st, done + n, tables, meta)
        meta.unpins, self._unpins = self._unpins, []
        return meta

    def _plan_save(self, st: _Req, computed: int, tables: Sequence[Sequence[int]], meta: LMCacheConnectorMetadata) -> None:
        assert self.plan is not None
        limit, n_full = self._savable(st, computed)
        chunks = list(range(st.saved_full, n_full))
        boundaries: list[tuple[bytes, int]] = []
        if self.plan.has_state:
            # vLLM materialises a recurrent state only where a step ends: a prefill step
            # (the state scheduler ends each on a chunk boundary) or, with
            # connector.save_decode_cache, the decode step that completes a chunk, so
            # the next turn of a chat resumes after the previous turn's answer.
            c = computed // self.cs - 1
            if computed % self.cs == 0 and computed <= limit and 0 <= c < len(st.hashes):
                boundaries.append((boundary_hash(st.hashes[c]), computed))
        elif self.plan.has_boundary:
            boundaries = [(boundary_hash(st.hashes[c]), (c + 1) * self.cs) for c in chunks]
        if not chunks and not boundaries:
            return
        if self.events is not None and st.request is not None:
            for c in chunks:
                self.events.remember(st.request, c, st.hashes[c], (c + 1) * self.cs)
            for key, end in boundaries:
                self.events.remember_boundary(st.request, key, end)
        first = chunks[0] if chunks else n_full
        meta.saves.append(
            ChunkTransfer(
                st.req_id,
                [st.hashes[c] for c in chunks],
                first,
                [(c + 1) * self.cs for c in chunks],
                list(tables[0]),
                group_block_ids=tuple(list(t) for t in tables),
                boundaries=boundaries,
                verify_below=st.verify_below,
            )
        )
        st.saved_full = max(st.saved_full, n_full)


def make_scheduler(settings: ConnectorSettings, *, plan: GroupPlan | None = None, **kw: Any) -> SchedulerSide:
    """The scheduler side for the model's KV-cache groups (chosen once)."""
    cls = GroupedScheduler if plan is not None and plan.hybrid else DenseScheduler
    return cls(settings, plan=plan, **kw)
