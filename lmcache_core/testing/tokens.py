"""Token-level access to a :class:`~lmcache_core.engine.CacheEngine`, for tests,
benchmarks and examples that think in token ids.

Production code never holds the tokens and the KV side by side: the connector's
scheduler hashes a prompt once and everything after it (lookup, load, save) goes
through the engine's hash-level API (``lookup_hashes``, ``lookup_runs``,
``store_hashes``, ``retrieve_hashes``, ``iter_chunks``). These functions do that
hashing for a caller that has a token sequence and whole chunk tensors::

    from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens

    store_tokens(engine, tokens, chunks)
    assert lookup_tokens(engine, tokens) == len(chunks) * engine.chunk_size
    assert retrieve_tokens(engine, tokens, outs) == len(chunks)

Each takes the engine first and otherwise the arguments of the engine method it
stands for.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..engine import CacheEngine, ChunkData
from ..keys import TokenIds, chain_seed, chunk_hashes

__all__ = ["lookup_tokens", "retrieve_tokens", "store_tokens", "token_hashes"]


def token_hashes(
    engine: CacheEngine,
    tokens: TokenIds,
    *,
    tags: Mapping[str, str] | None = None,
    extras: Mapping[int, bytes] | None = None,
    include_partial: bool = False,
) -> list[bytes]:
    """The chained prefix hashes of ``tokens``' chunks under ``engine``'s chunk size:
    the keys the engine stores them under (see :meth:`CacheEngine.keys`). ``tags``
    seed the chain, ``extras`` mix bytes into the chunks they index; a partial last
    chunk is hashed when ``include_partial`` (as the connector does with
    ``connector.save_unfull_chunk``)."""
    return chunk_hashes(tokens, engine.chunk_size, seed=chain_seed(tags), extras=extras, include_partial=include_partial)


def _chunk_tokens(engine: CacheEngine, n_tokens: int, n_chunks: int, start_chunk: int = 0) -> int:
    """Tokens of an ``n_tokens`` sequence in chunks ``start_chunk`` to
    ``start_chunk + n_chunks`` (the last chunk may be partial)."""
    cs = engine.chunk_size
    return max(0, min(n_tokens, (start_chunk + n_chunks) * cs) - start_chunk * cs)


def lookup_tokens(
    engine: CacheEngine,
    tokens: TokenIds,
    *,
    tags: Mapping[str, str] | None = None,
    extras: Mapping[int, bytes] | None = None,
    pin_id: str | None = None,
) -> int:
    """Number of leading tokens of ``tokens`` whose KV is cached in some tier of
    ``engine`` (:meth:`CacheEngine.lookup_hashes` in tokens; ``pin_id`` pins the hits
    as it does there)."""
    hashes = token_hashes(engine, tokens, tags=tags, extras=extras)
    n = engine.lookup_hashes(hashes, pin_id=pin_id)
    return _chunk_tokens(engine, len(tokens), n)


def store_tokens(
    engine: CacheEngine,
    tokens: TokenIds,
    chunks: Sequence[ChunkData],
    *,
    start_chunk: int = 0,
    tags: Mapping[str, str] | None = None,
    extras: Mapping[int, bytes] | None = None,
) -> int:
    """Store ``chunks[i]`` as chunk ``start_chunk + i`` of ``tokens``; returns how many
    new chunks reached the first tier (:meth:`CacheEngine.store_hashes`). Raises
    ``ValueError`` when ``tokens`` hold fewer chunks than given."""
    hashes = token_hashes(engine, tokens, tags=tags, extras=extras)[start_chunk : start_chunk + len(chunks)]
    if len(hashes) < len(chunks):
        raise ValueError(f"{len(chunks)} chunks given but tokens hold only {len(hashes)} from chunk {start_chunk}")
    return engine.store_hashes(hashes, chunks, n_tokens=_chunk_tokens(engine, len(tokens), len(chunks), start_chunk))


def retrieve_tokens(
    engine: CacheEngine,
    tokens: TokenIds,
    outs: Sequence[torch.Tensor],
    *,
    start_chunk: int = 0,
    tags: Mapping[str, str] | None = None,
    extras: Mapping[int, bytes] | None = None,
) -> int:
    """Fill ``outs[i]`` with chunk ``start_chunk + i`` of ``tokens``; returns how many
    leading chunks were retrieved (the rest must be recomputed). A partial last chunk
    is always hashed, so it loads if it was stored (:meth:`CacheEngine.retrieve_hashes`,
    which reads through :meth:`CacheEngine.iter_chunks`, the connector's read path)."""
    hashes = token_hashes(engine, tokens, tags=tags, extras=extras, include_partial=True)
    return engine.retrieve_hashes(hashes[start_chunk : start_chunk + len(outs)], outs)
