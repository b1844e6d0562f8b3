"""The memory pool: buffers are views into one pre-allocated region, not allocations;
memory returns only at the last release; a full pool answers None and recovers; bad
shapes are refused; any order of allocations and frees coalesces back to one free
region; the byte budget holds under concurrent use; buffers of one shape and dtype
share one layout."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_core.memory import ALIGN, MemoryBuffer, MemoryPool


def test_buffers_are_views_into_the_pool() -> None:
    pool = MemoryPool(1 << 20)
    bufs = [pool.allocate((3, 100), torch.float16), pool.allocate((7,), torch.float32), pool.allocate((0,), torch.int8)]
    assert all(b is not None for b in bufs)
    spans = []
    for b in bufs:
        assert b is not None and pool.owns(b.tensor)
        spans.append((b.offset, b.offset + b.size))
    assert not pool.owns(torch.empty(10))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "live buffers overlap"
    b0 = bufs[0]
    assert b0 is not None and b0.tensor.shape == (3, 100) and b0.tensor.dtype == torch.float16
    b0.tensor.fill_(1.5)
    assert torch.equal(b0.tensor, torch.full((3, 100), 1.5, dtype=torch.float16))


def test_refcount_returns_memory_only_at_last_release() -> None:
    pool = MemoryPool(1 << 16)
    buf = pool.allocate((1000,), torch.uint8)
    assert buf is not None and buf.refcount == 1
    used = pool.used
    assert used == 1024
    buf.retain()
    buf.retain()
    buf.release()
    buf.release()
    assert pool.used == used and buf.refcount == 1
    buf.release()
    assert pool.used == 0 and buf.refcount == 0
    with pytest.raises(RuntimeError):
        buf.release()
    with pytest.raises(RuntimeError):
        buf.retain()


def test_full_pool_returns_none_then_recovers() -> None:
    pool = MemoryPool(4 * ALIGN)
    bufs = [pool.allocate((ALIGN,), torch.uint8) for _ in range(4)]
    assert all(bufs) and pool.free_bytes == 0
    assert pool.allocate((1,), torch.uint8) is None
    bufs[1].release()  # type: ignore[union-attr]
    again = pool.allocate((ALIGN,), torch.uint8)
    assert again is not None and again.offset == bufs[1].offset  # type: ignore[union-attr]


def test_bad_shapes_are_rejected() -> None:
    pool = MemoryPool(1 << 16)
    with pytest.raises(ValueError):
        pool.allocate((-1, 4), torch.float16)
    assert pool.used == 0
    with pytest.raises(ValueError):
        MemoryPool(0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 3 * ALIGN), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_any_alloc_free_order_coalesces_to_one_region(sizes: list[int], rnd: random.Random) -> None:
    pool = MemoryPool(64 * ALIGN)
    live: list[MemoryBuffer] = []
    for size in sizes:
        b = pool.allocate((size,), torch.uint8)
        if b is None:
            break
        live.append(b)
        if rnd.random() < 0.3 and live:  # interleave frees with allocations
            live.pop(rnd.randrange(len(live))).release()
    rnd.shuffle(live)
    for b in live:
        b.release()
    assert pool.used == 0
    assert pool.free_regions == 1
    assert pool.largest_free() == pool.capacity
    whole = pool.allocate((pool.capacity,), torch.uint8)
    assert whole is not None and whole.offset == 0


def test_budget_holds_under_concurrent_use() -> None:
    pool = MemoryPool(64 * 1024)
    live: dict[int, tuple[int, int]] = {}
    lock = threading.Lock()
    errors: list[str] = []
    max_used = [0]

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        mine: list[MemoryBuffer] = []
        for _ in range(1500):
            if mine and (rnd.random() < 0.5 or len(mine) > 8):
                b = mine.pop(rnd.randrange(len(mine)))
                with lock:
                    del live[id(b)]
                if not torch.all(b.tensor == seed % 251):
                    errors.append("buffer content changed under its owner")
                b.release()
                continue
            b = pool.allocate((rnd.randint(1, 6000),), torch.uint8)
            if b is None:
                continue
            b.tensor.fill_(seed % 251)
            with lock:
                for off, end in live.values():
                    if b.offset < end and off < b.offset + b.size:
                        errors.append("two live buffers overlap")
                live[id(b)] = (b.offset, b.offset + b.size)
                used = pool.used
                max_used[0] = max(max_used[0], used)
                if used > pool.capacity or used < sum(e - o for o, e in live.values()):
                    errors.append(f"used={used} out of bounds")
            mine.append(b)
        for b in mine:
            with lock:
                del live[id(b)]
            b.release()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:5]
    assert max_used[0] > pool.capacity // 2, "the test never put the pool under pressure"
    assert pool.used == 0 and pool.free_regions == 1 and pool.largest_free() == pool.capacity


def test_buffers_share_one_layout_per_shape_and_dtype() -> None:
    pool = MemoryPool(1 << 16, pin=False)
    a = pool.allocate((4, 8), torch.float16)
    b = pool.allocate([4, 8], torch.float16)  # a list of the same shape: the same layout
    c = pool.allocate((4, 8), torch.float32)
    assert a is not None and b is not None and c is not None
    assert a._layout is b._layout and a._layout is not c._layout
    assert not hasattr(a, "__dict__")  # slots only: a resident chunk costs one small object
    assert (a.shape, a.dtype, a.nbytes, a.size) == ((4, 8), torch.float16, 64, ALIGN)
    assert (c.shape, c.dtype, c.nbytes, c.size) == ((4, 8), torch.float32, 128, ALIGN)
    assert a.offset != b.offset and tuple(b.tensor.shape) == (4, 8) and c.tensor.dtype == torch.float32
    for buf in (a, b, c):
        buf.release()
    assert pool.used == 0
