"""What the connector must store for each of vLLM's KV-cache groups.

With vLLM's hybrid KV cache manager a model's layers fall into groups, one attention
kind per group, each with its own block table (block ids are unique across groups:
the groups overlay one memory pool). What a later request needs to resume after
``E`` cached tokens differs per kind:

* ``full`` (full attention, MLA): the KV of every token ``0..E`` -- stored per chunk,
  in the chunk's own object, as for dense models;
* ``window`` (sliding-window attention, window ``W``): only the last ``W`` tokens
  before ``E`` -- stored in the *boundary object* of ``E``;
* ``state`` (Mamba, Mamba2, gated delta-net, ...): the recurrent state after exactly
  ``E`` tokens (one state page per layer) -- in the boundary object of ``E`` too. vLLM
  materialises a state only where a scheduler step ends, so boundary objects of these
  models exist at the chunk boundaries where a step ended (vLLM's own prefix caching
  for these models has the same limit).

A hit of ``n`` chunks needs chunk objects ``0..n-1`` and the boundary object after
chunk ``n-1``. Boundary objects live under their own hash (:func:`boundary_hash`), so
a chunk can be present without one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from lmcache_core.keys import HASH_BYTES

FULL, WINDOW, STATE = "full", "window", "state"
_BOUNDARY_KEY = b"lmcache-core/boundary/v1"


class UnsupportedGroupError(ValueError):
    """A KV-cache group of a kind the connector cannot restore."""


@dataclass(frozen=True)
class GroupInfo:
    index: int
    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    window: int = 0  # sliding window in tokens (kind == window)
    state_mode: str = ""  # vLLM's mamba cache mode (kind == state): "align" or "none"

    def tag(self) -> str:
        if self.kind == WINDOW:
            return f"W{self.window}/bs{self.block_size}/L{len(self.layer_names)}"
        if self.kind == STATE:
            return f"S{self.state_mode}/bs{self.block_size}/L{len(self.layer_names)}"
        return f"F/bs{self.block_size}/L{len(self.layer_names)}"

    def window_blocks(self, end: int) -> range:
        """Block indexes holding the tokens a request resuming at ``end`` or ``end-1``
        attends to: tokens ``end - window .. end`` (one token more than the window so a
        hit capped one token short of ``end`` is covered too)."""
        bs = self.block_size
        return range(max(0, end - self.window) // bs, -(-end // bs))

    def state_slot(self, end: int) -> int:
        """Index of the block holding the state after ``end`` tokens (vLLM: slot ``p``
        holds the state after ``(p + 1) * block_size`` tokens; with one slot per
        request, mode "none", that is slot 0)."""
        return -(-end // self.block_size) - 1


@dataclass(frozen=True)
class GroupPlan:
    groups: tuple[GroupInfo, ...]

    @property
    def hybrid(self) -> bool:
        """More than one group or any non-full group: the grouped path is used."""
        return len(self.groups) > 1 or any(g.kind != FULL for g in self.groups)

    @property
    def has_state(self) -> bool:
        return any(g.kind == STATE for g in self.groups)

    @property
    def has_boundary(self) -> bool:
        return any(g.kind != FULL for g in self.groups)

    def of_kind(self, *kinds: str) -> list[GroupInfo]:
        return [g for g in self.groups if g.kind in kinds]

    def token_block_size(self) -> int:
        """Block size that token positions align to (attention groups; aligned state
        groups share it)."""
        sizes = {g.block_size for g in self.groups if g.kind != STATE or g.state_mode == "align"}
        if not sizes:  # only unaligned state groups: any chunk size works
            return 1
        return math.lcm(*sizes)

    def fingerprint(self) -> str:
        return "groups:" + ",".join(g.tag() for g in self.groups)

    def describe(self) -> str:
        return ", ".join(
            f"{g.kind}"
            + (f"(window {g.window})" if g.kind == WINDOW else "")
            + (f"({g.state_mode})" if g.kind == STATE else "")
            + f" x{len(g.layer_names)}"
            for g in self.groups
        )


def _kind(spec: Any) -> str | None:
    """The storage kind of a vLLM KV-cache spec, or None for kinds whose blocks do
    not simply hold the tokens they cover (middle-gap eviction, sinks, ...)."""
    import vllm.v1.kv_cache_interface as kvi

    odd = tuple(getattr(kvi, n) for n in ("RSWASpec", "SinkFullAttentionSpec", "HiddenStateCacheSpec") if hasattr(kvi, n))
    if isinstance(spec, odd):
        return None
    if isinstance(spec, kvi.SlidingWindowSpec):
        return WINDOW
    if isinstance(spec, kvi.MambaSpec):
        return STATE
    if isinstance(spec, kvi.FullAttentionSpec):
        # Also sliding-window or chunked-local layers that vLLM folded into a full
        # group (hybrid manager off): their blocks keep every token.
        return FULL
    return None


def describe_groups(kv_cache_config: Any, default_block_size: int) -> GroupPlan:
    """The connector's view of ``KVCacheConfig.kv_cache_groups`` (one full group of
    block size ``default_block_size`` when vLLM gives no config). A single group of a
    kind not listed here keeps the dense path (whole blocks, as before hybrid
    support); several groups with such a kind are refused."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return GroupPlan((GroupInfo(0, FULL, default_block_size, ()),))
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        names = tuple(g.layer_names)
        kind = _kind(spec)
        if kind is None and len(groups) == 1:
            kind = FULL
        if kind == WINDOW:
            out.append(GroupInfo(i, WINDOW, spec.block_size, names, window=int(spec.sliding_window)))
        elif kind == STATE:
            out.append(GroupInfo(i, STATE, spec.block_size, names, state_mode=str(spec.mamba_cache_mode)))
        elif kind == FULL:
            out.append(GroupInfo(i, FULL, spec.block_size, names))
        else:
            raise UnsupportedGroupError(
                f"KV-cache group {i} ({type(spec).__name__}, layers {', '.join(names[:3])}...) is not supported by "
                "LMCacheCoreConnector: supported are full attention, MLA, sliding-window attention and state-space / "
                "linear-attention (Mamba, Mamba2, gated delta-net) layers"
            )
    return GroupPlan(tuple(out))


def effective_chunk_size(configured: int, plan: GroupPlan) -> int:
    """``configured`` when it is a multiple of the model's token block size, else the
    smallest multiple of that block size not below it."""
    bs = plan.token_block_size()
    if configured % bs == 0:
        return configured
    return -(-configured // bs) * bs


#: the dotted path of lmcache-core's state scheduler, given to vLLM as ``--scheduler-cls``
#: (:mod:`lmcache_connector.state_scheduler`)
STATE_SCHEDULER = "lmcache_connector.state_scheduler.StateBoundaryScheduler"


def state_advice(plan: GroupPlan, chunk_size: int, state_scheduler: bool = False) -> str | None:
    """A start-up warning for a model with state-space layers when the states after
    some whole chunks of a prompt will not exist: vLLM keeps a recurrent state only
    where a step ends, and unless lmcache-core's state scheduler runs
    (``state_scheduler``), neither vLLM's default scheduling nor its "align" mamba
    cache mode makes every prefill step end on a chunk boundary. None when nothing is
    to be said."""
    states = plan.of_kind(STATE)
    if not states or state_scheduler:
        return None
    layers = sum(len(g.layer_names) for g in states)
    aligned = all(g.state_mode == "align" for g in states)
    where = (
        "vLLM's 'align' mamba cache mode (prefix caching on) ends prefill steps only on the last block boundary "
        "before a prompt's end"
        if aligned
        else "vLLM's prefix caching is off, so a recurrent state exists only where a prefill step ends"
    )
    return (
        f"this model has {layers} state-space layer(s) (Mamba / gated delta-net) and {where}: a prompt prefilled in "
        f"one step leaves no state at its earlier chunk boundaries (every {chunk_size} tokens), so a later request "
        f"sharing only part of it cannot resume. Start vLLM with --scheduler-cls {STATE_SCHEDULER} (prefill steps then "
        f"end on chunk boundaries and every whole chunk's state is stored; cost in docs/benchmarks.md). See "
        f"docs/connector.md, 'Models'"
    )


def boundary_hash(chunk_hash: bytes) -> bytes:
    """Hash of the boundary object after the chunk named ``chunk_hash``."""
    return hashlib.blake2b(chunk_hash, digest_size=HASH_BYTES, key=_BOUNDARY_KEY).digest()
