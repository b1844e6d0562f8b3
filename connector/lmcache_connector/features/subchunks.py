"""Sub-chunk hits: serve the blocks a prompt shares with a stored chunk whose rest differs.

Chunks are the unit of storage (256 tokens by default), vLLM's blocks are smaller (128
on CPU, 16 on GPUs). Two prompts that share 2,000 tokens share 7 whole chunks of 256,
and 1,920 tokens in whole blocks: with chunk keys alone the 8th chunk is a miss, and
vLLM recomputes 208 tokens its own prefix cache would have served in whole blocks.

The scheduler keeps an index, bounded and in memory, from the hash of a chunk's first
``k`` blocks (:func:`lmcache_core.keys.sub_chunk_hashes`, chained from the chunk
before) to the stored chunk that starts with them. It learns every chunk the scheduler
saves or loads, and the whole blocks of each prompt's trailing partial chunk, which
the scheduler saves for this (a "block tail": the prompt's last whole blocks past its
last whole chunk, or the partial chunk itself with ``save_unfull_chunk``). A lookup sends, next to the request's chunk hashes, the stored chunk
whose first blocks match the request's chunk ``i`` (for each ``i`` the index knows);
when the request's hit ends at exactly that chunk the worker checks it is present and
pins it, and the scheduler loads it whole but writes only its matching blocks.

Nothing here can serve wrong KV beyond what a chunk key can: a sub-chunk hash covers
the chain before the chunk and the matching tokens, as a chunk key does. The index is
per scheduler (it restarts empty) and a stored chunk that was evicted is simply
reported absent by the lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from lmcache_core.keys import TokenIds, sub_chunk_hashes

#: entries (one per block boundary inside a chunk) kept, least recently used dropped
MAX_ENTRIES = 1 << 16


class SubChunkIndex:
    """sub-chunk hash -> (stored chunk's hash, tokens of it that the hash covers,
    tokens the stored chunk holds)."""

    def __init__(self, chunk_size: int, block_size: int, max_entries: int = MAX_ENTRIES) -> None:
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.max_entries = max_entries
        self._map: OrderedDict[bytes, tuple[bytes, int, int]] = OrderedDict()

    @property
    def useful(self) -> bool:
        """Whether a chunk has block boundaries inside it at all."""
        return 0 < self.block_size < self.chunk_size

    def __len__(self) -> int:
        return len(self._map)

    def prefixes(self, prev: bytes, tokens: TokenIds, extra: bytes = b"", *, whole: bool = True) -> list[bytes]:
        """Sub-chunk hashes of one chunk's ``tokens`` (``whole``: a full chunk, whose
        last block is the chunk itself; else a prompt's trailing partial chunk, every
        whole block of it)."""
        if not self.useful:
            return []
        count = None if whole else len(tokens) // self.block_size
        return sub_chunk_hashes(prev, tokens, self.block_size, extra=extra, count=count)

    def remember(self, prefixes: Sequence[bytes], chunk_hash: bytes, stored: int | None = None) -> None:
        """Chunk ``chunk_hash`` (``stored`` tokens, a whole chunk by default) is stored
        and starts with the blocks ``prefixes`` name."""
        m = self._map
        stored = self.chunk_size if stored is None else stored
        for j, sub in enumerate(prefixes):
            m[sub] = (chunk_hash, (j + 1) * self.block_size, stored)
            m.move_to_end(sub)
        while len(m) > self.max_entries:
            m.popitem(last=False)

    def candidate(self, prefixes: Sequence[bytes], own: bytes | None) -> tuple[bytes, int, int] | None:
        """The stored chunk that shares the most of ``prefixes`` (longest first): its
        hash, the tokens shared, the tokens it holds; never the request's own chunk
        ``own`` (that is a plain hit)."""
        m = self._map
        for sub in reversed(prefixes):
            got = m.get(sub)
            if got is not None and got[0] != own:
                return got
        return None
