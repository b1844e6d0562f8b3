"""The per-step plan the scheduler side sends to the workers (pickled by vLLM).

Only plain data: chunk hashes (16 bytes each), token ranges and block ids. Workers
combine the hashes with their own key namespace (model, layout, TP rank), so the
scheduler never needs to know the KV layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ChunkTransfer:
    """Chunks ``first_chunk .. first_chunk + len(hashes)`` of one request.

    ``chunk_ends[i]`` is the token index where chunk i ends (chunk_size multiples,
    or the prompt length for a trailing partial chunk)."""

    req_id: str
    hashes: list[bytes]
    first_chunk: int
    chunk_ends: list[int]
    block_ids: list[int]
    write_from: int = 0  # loads: tokens below this are vLLM's own and are not written
    # Models with several KV-cache groups (see groups.py): every group's block table,
    # and the boundary objects to load (one, after the last chunk) or save.
    group_block_ids: tuple[list[int], ...] | None = None
    boundaries: list[tuple[bytes, int]] = field(default_factory=list)  # (hash, end token)
    async_load: bool = False  # report completion through get_transfer_results (failed_recving)
    verify_below: int = 0  # saves: chunks below this index are compared with the cache (canary), not stored
    # loads: the last hash is a stored chunk of this many tokens of which only the
    # tokens up to its chunk_ends entry are written (a sub-chunk hit, subchunks.py)
    tail_tokens: int = 0


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    chunk_size: int = 256
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    unpins: list[str] = field(default_factory=list)
    # what this step computes, for the worker's recompute-cost model (load_policy)
    step_tokens: int = 0
    step_pairs: float = 0.0
    # async_saves: a request with saves in flight was preempted (its blocks are
    # free again): finish the queued saves before this step writes any block
    drain_saves: bool = False
    # async_saves: finished requests whose background saves the workers had reported
    # done, so vLLM freed their blocks at once: not to be reported in finished_sending
    freed_early: list[str] = field(default_factory=list)
    # retention hints of the requests whose loads or saves this step carries:
    # req_id -> (seconds, priority) (lmcache_core.retention)
    retain: dict[str, tuple[float, int]] = field(default_factory=dict)

    def chunk_start(self, t: ChunkTransfer, i: int) -> int:
        return (t.first_chunk + i) * self.chunk_size

    def stored_tokens(self, t: ChunkTransfer, i: int) -> int:
        """Tokens of chunk ``i`` of ``t`` as stored (the chunk read from the cache)."""
        if t.tail_tokens and i == len(t.hashes) - 1:
            return t.tail_tokens
        return t.chunk_ends[i] - self.chunk_start(t, i)


@dataclass
class SaveProgress(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step with background saves (``async_saves``): per
    request not yet finished in vLLM, how many of its save transfers are done. With
    several ranks vLLM aggregates the workers' objects: a request counts as done as
    far as every rank got (the minimum; a request one rank does not list is left out).
    Every worker sends one each step, so the minimum is over all of them."""

    done: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "SaveProgress":
        theirs = other.done if isinstance(other, SaveProgress) else {}
        return SaveProgress({r: min(n, theirs[r]) for r, n in self.done.items() if r in theirs})
