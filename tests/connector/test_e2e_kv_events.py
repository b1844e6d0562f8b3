"""KV events on real vLLM: a ZMQ subscriber on a running engine receives lmcache-core's
stores and evictions per tier, in vLLM's event format, with the block hashes vLLM
itself publishes for the same blocks (prefix caching on: vLLM's own GPU events are the
reference), and a ``medium`` naming the tier."""

from __future__ import annotations

import time
from typing import Any

import pytest

from .conftest import greedy, make_llm, random_prompt, run, worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CHUNK_BYTES = 256 << 10  # one 256-token chunk of the tiny model (checked below)
BLOCK = 128  # vLLM-CPU block size
CPU, DISK = "lmcache:local_cpu", "lmcache:disk"
NO_SAVE = {"lmcache.skip_save": True}  # warm-up prompts of one whole block: no block tail saved


class Subscriber:
    """Connects to the engine's publisher (which binds an ipc:// endpoint)."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(endpoint)
        self.decoder = Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                break
            topic, _seq, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            self.events.extend(self.decoder.decode(payload).events)

    def of(self, kind: str, medium: str, start: int = 0) -> list[Any]:
        """Events of ``kind`` in ``medium``, from the ``start``-th received on."""
        return [e for e in self.events[start:] if type(e).__name__ == kind and e.medium == medium]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _hashes(events: list[Any]) -> list[Any]:
    return [h for e in events for h in e.block_hashes]


def test_zmq_subscriber_sees_tier_stores_and_evictions(tiny_model, tmp_path):
    pytest.importorskip("lmcache_backend_disk")
    from vllm.config import KVEventsConfig

    endpoint = f"ipc://{tmp_path / 'kv-events.sock'}"
    sub = None
    tiers = [
        {"name": "local_cpu", "max_size": f"{2 * CHUNK_BYTES + 1024}B", "eviction": "lru"},
        {"name": "disk", "path": str(tmp_path / "kv")},
    ]
    events_cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    a, b, c = random_prompt(520, 501), random_prompt(520, 502), random_prompt(520, 503)
    try:
        with make_llm(tiny_model, prefix_caching=True, extra={"backends": tiers}, kv_events_config=events_cfg) as llm:
            sub = Subscriber(endpoint)
            for i in range(50):  # the subscription reaches the publisher asynchronously
                run(llm, [random_prompt(130, 700 + i)], greedy(2, NO_SAVE))  # one full vLLM block, under a chunk
                sub.drain(0.2)
                if sub.events:
                    break
            assert sub.events, "the subscriber never received vLLM's own events"
            sub.events.clear()
            assert worker().hits.chunk_bytes == CHUNK_BYTES
            run(llm, [a])
            # The disk write is in the background: its event ships with a later step.
            for _ in range(30):
                sub.drain(0.5)
                if len(sub.of("BlockStored", DISK)) >= 2:
                    break
                run(llm, [random_prompt(40, 600)], greedy(2))  # under a chunk: saves nothing
            gpu = _hashes(sub.of("BlockStored", "GPU"))
            stored_cpu, stored_disk = sub.of("BlockStored", CPU), sub.of("BlockStored", DISK)
            # One event per chunk per tier, each with vLLM's own hashes of its two blocks.
            assert [len(e.block_hashes) for e in stored_cpu] == [2, 2]
            a_blocks = _hashes(stored_cpu)
            assert a_blocks == gpu[:4], "our block hashes differ from vLLM's for the same blocks"
            assert _hashes(stored_disk) == a_blocks
            assert stored_cpu[0].parent_block_hash is None and stored_cpu[1].parent_block_hash == a_blocks[1]
            assert [t for e in stored_cpu for t in e.token_ids] == a[:512]
            assert {e.block_size for e in stored_cpu} == {BLOCK}
            assert sub.of("BlockRemoved", CPU) == []

            # B's two chunks push A's out of the 2-chunk CPU tier; the disk keeps all.
            run(llm, [b])
            for _ in range(30):
                sub.drain(0.5)
                if len(sub.of("BlockStored", DISK)) >= 4:
                    break
                run(llm, [random_prompt(40, 601)], greedy(2))
            removed = sub.of("BlockRemoved", CPU)
            assert sorted(_hashes(removed)) == sorted(a_blocks)
            assert _hashes(sub.of("BlockStored", CPU))[4:] == _hashes(sub.of("BlockStored", DISK))[4:]
            assert sub.of("BlockRemoved", DISK) == []

            # Negative control: a request that skips saving stores nothing, so no
            # lmcache-core event names its blocks (vLLM's GPU events still do).
            before = len(sub.events)
            run(llm, [c], greedy(params={"lmcache.skip_save": True}))
            run(llm, [random_prompt(40, 602)], greedy(2))
            sub.drain(1.0)
            new = sub.events[before:]
            c_gpu = _hashes([e for e in new if type(e).__name__ == "BlockStored" and e.medium == "GPU"])
            assert len(c_gpu) >= 4
            ours = [e for e in new if (e.medium or "").startswith("lmcache:")]
            assert not set(_hashes(ours)) & set(c_gpu)
    finally:
        if sub is not None:
            sub.close()


# -- hybrid models: one event per KV-cache group, as vLLM's own events -----------------
HYBRID = {
    # Gemma 3: groups 0-2 sliding window 160, group 3 full; chunk 256, blocks of 128.
    # A prompt's objects take 2.6 MB in the CPU tier (1.4 MB for Qwen3-Next): the tier
    # holds the warm-up and one prompt, and three prompts overflow it.
    "gemma3": dict(prompt=1500, tier="4MB", llm={}),
    # Qwen3-Next: groups 0-2 gated delta-net ("align" mode, blocks of 384), group 3 full;
    # chunk 384; a state is kept where a step ends on a chunk boundary (768).
    "qwen3_next": dict(prompt=1500, tier="3MB", llm={"dtype": "bfloat16", "max_num_batched_tokens": 768}),
}


def _groups(events: list[Any]) -> dict[int, tuple[Any, Any, int]]:
    """group_idx -> (kind, sliding window, block size) as the events describe it."""
    return {e.group_idx: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size) for e in events}


@pytest.mark.parametrize("family", list(HYBRID))
def test_hybrid_groups_are_announced_like_vllms_own(family, tmp_path):
    """Per group: vLLM's group index, spec kind and window, the group's block size and
    vLLM's hashes for the blocks each object holds (full groups: the chunk's blocks;
    window groups: the window before the boundary; state groups: the block whose state
    is the boundary's); evictions name the group; a request that saves nothing is never
    announced."""
    from vllm.config import KVEventsConfig

    from lmcache_connector.dev.tiny_hybrid import build_hybrid_model

    case = HYBRID[family]
    model = build_hybrid_model(tmp_path / family, family)
    endpoint = f"ipc://{tmp_path / 'kv-events.sock'}"
    events_cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    tiers = [{"name": "local_cpu", "max_size": case["tier"], "eviction": "lru"}]
    a, b, c = (random_prompt(case["prompt"], 511 + i) for i in range(3))
    sub = None
    try:
        with make_llm(model, prefix_caching=True, extra={"backends": tiers}, kv_events_config=events_cfg, **case["llm"]) as llm:
            w = worker()
            plan = {g.index: g for g in w.plan.groups}
            cs = w.settings.core.chunk_size
            sub = Subscriber(endpoint)
            for i in range(50):  # the subscription reaches the publisher asynchronously
                run(llm, [random_prompt(cs + 10, 700 + i)], greedy(2))
                sub.drain(0.2)
                if sub.events:
                    break
            assert sub.events, "the subscriber never received vLLM's own events"
            start = len(sub.events)  # the warm-up's events stay: its objects are evicted below
            run(llm, [a], greedy(2))
            run(llm, [random_prompt(40, 600)], greedy(2))
            sub.drain(1.0)
            gpu = sub.of("BlockStored", "GPU", start)
            ours = sub.of("BlockStored", CPU, start)
            full = [g for g, info in plan.items() if info.kind == "full"]
            # vLLM's own hashes of A's blocks (its full-attention group keeps them all;
            # a block's hash is the same in every group).
            ref = _hashes([e for e in gpu if e.group_idx == full[0]])
            assert len(ref) >= (case["prompt"] // cs) * cs // plan[full[0]].block_size
            # The same group metadata as vLLM's events for the same groups.
            assert _groups(ours) == {g: v for g, v in _groups(gpu).items() if g in _groups(ours)}
            assert set(_groups(ours)) == set(plan) - {
                g for g, info in plan.items() if info.kind == "state" and info.state_mode != "align"
            }
            for e in ours:
                bs = e.block_size
                first = ref.index(e.block_hashes[0])
                assert e.block_hashes == ref[first : first + len(e.block_hashes)], "not vLLM's hashes for these blocks"
                assert e.token_ids == a[first * bs : (first + len(e.block_hashes)) * bs]
                assert e.parent_block_hash == (ref[first - 1] if first else None)
                g = plan[e.group_idx]
                end = (first + len(e.block_hashes)) * bs
                if g.kind == "window":  # the window a hit at the boundary ``end`` needs
                    assert end % cs == 0 and first == max(0, end - g.window) // bs
                elif g.kind == "state":  # the one block whose state is the boundary's
                    assert end % cs == 0 and len(e.block_hashes) == 1
            # Full groups: every full chunk of A, chunk by chunk.
            n_chunks = min(case["prompt"] // cs, len(ref) * plan[full[0]].block_size // cs)
            for g in full:
                assert _hashes([e for e in ours if e.group_idx == g]) == ref[: n_chunks * cs // plan[g].block_size]
            assert not set(_hashes(sub.of("BlockRemoved", CPU, start))) & set(ref)

            # B and C push A's objects out of the tier: removals name the group.
            run(llm, [b], greedy(2))
            run(llm, [c], greedy(2))
            run(llm, [random_prompt(40, 601)], greedy(2))
            sub.drain(1.0)
            removed = sub.of("BlockRemoved", CPU)
            assert removed, "nothing was evicted from the CPU tier"
            announced = {(e.group_idx, h) for e in sub.of("BlockStored", CPU) for h in e.block_hashes}
            assert all((e.group_idx, h) in announced for e in removed for h in e.block_hashes)
            assert {(e.group_idx, h) for e in removed for h in e.block_hashes} & {(g, h) for g in full for h in ref}

            # Negative control: a request that skips saving is never announced by us.
            before = len(sub.events)
            d = random_prompt(case["prompt"], 520)
            run(llm, [d], greedy(params={"lmcache.skip_save": True}))
            run(llm, [random_prompt(40, 602)], greedy(2))
            sub.drain(1.0)
            new = sub.events[before:]
            d_gpu = _hashes([e for e in new if type(e).__name__ == "BlockStored" and e.medium == "GPU"])
            assert len(d_gpu) >= 4
            assert not set(_hashes([e for e in new if (e.medium or "").startswith("lmcache:")])) & set(d_gpu)
    finally:
        if sub is not None:
            sub.close()


# -- shared stores: what the server drops reaches the subscriber ------------------------
def test_zmq_subscriber_sees_redis_expiries(tiny_model, tmp_path):
    """A real redis-server expires the chunks (``ttl_s``): the subscriber gets
    ``BlockRemoved`` in ``lmcache:redis`` for exactly the blocks announced there, while
    the CPU tier, which still holds them, announces no removal."""
    pytest.importorskip("lmcache_backend_redis")
    import sys
    from pathlib import Path

    from vllm.config import KVEventsConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
    from redis_server import RedisServer

    server = RedisServer()
    endpoint = f"ipc://{tmp_path / 'kv-events.sock'}"
    sub = None
    tiers = [
        {"name": "local_cpu", "max_size": "64MiB"},
        {"name": "redis", "url": server.url, "prefix": "ev:", "ttl_s": 3},
    ]
    events_cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    a = random_prompt(520, 511)
    try:
        with make_llm(tiny_model, prefix_caching=True, extra={"backends": tiers}, kv_events_config=events_cfg) as llm:
            sub = Subscriber(endpoint)
            for i in range(50):  # the subscription reaches the publisher asynchronously
                run(llm, [random_prompt(130, 710 + i)], greedy(2, NO_SAVE))
                sub.drain(0.2)
                if sub.events:
                    break
            assert sub.events, "the subscriber never received vLLM's own events"
            sub.events.clear()
            run(llm, [a])
            # Stored in Redis in the background, then expired 3 s later: both ship with later steps.
            for i in range(60):
                sub.drain(0.5)
                if len(sub.of("BlockRemoved", "lmcache:redis")) >= 2:
                    break
                run(llm, [random_prompt(40, 620 + i)], greedy(2))  # under a chunk: saves nothing
            # The tier writes chunks concurrently (write_concurrency): in either order.
            stored = sorted(_hashes(sub.of("BlockStored", "lmcache:redis")))
            assert len(stored) == 4 and stored == sorted(_hashes(sub.of("BlockStored", CPU)))
            assert sorted(_hashes(sub.of("BlockRemoved", "lmcache:redis"))) == stored
            assert sub.of("BlockRemoved", CPU) == []  # negative control: the CPU tier still holds them
            assert server.client().keys("ev:v1-*") == []  # no chunk left (the namespace record stays)
    finally:
        if sub is not None:
            sub.close()
        server.kill()


def test_zmq_subscriber_sees_peer_node_evictions(tiny_model, tmp_path):
    """A real ``lmcache-core serve`` node holding two and a half chunks: prompt B's
    chunks evict prompt A's there, and the subscriber gets ``BlockRemoved`` in
    ``lmcache:peer`` for exactly A's blocks (none of B's, which the node still holds)."""
    pytest.importorskip("lmcache_backend_peer")
    import sys
    from pathlib import Path

    from vllm.config import KVEventsConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
    from peer_node import PeerNode

    secret = tmp_path / "peer.secret"
    secret.write_text("kv-events-e2e-secret-0123456789\n")
    secret.chmod(0o600)
    node = PeerNode(["--max-size", str(CHUNK_BYTES * 5 // 2)], secret)
    endpoint = f"ipc://{tmp_path / 'kv-events.sock'}"
    sub = None
    peer = {"name": "peer", "peers": [node.address], "secret_file": str(secret), "push": True, "max_size": 0}
    tiers = [{"name": "local_cpu", "max_size": "64MiB"}, {**peer, "eviction_poll_s": 0.1}]
    events_cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    a, b = random_prompt(520, 521), random_prompt(520, 522)
    medium = "lmcache:peer"
    try:
        with make_llm(tiny_model, prefix_caching=True, extra={"backends": tiers}, kv_events_config=events_cfg) as llm:
            sub = Subscriber(endpoint)
            for i in range(50):  # the subscription reaches the publisher asynchronously
                run(llm, [random_prompt(130, 730 + i)], greedy(2, NO_SAVE))
                sub.drain(0.2)
                if sub.events:
                    break
            assert sub.events, "the subscriber never received vLLM's own events"
            sub.events.clear()

            def settle(want_stored: int, want_removed: int, seed: int) -> None:
                for i in range(60):
                    sub.drain(0.3)
                    if len(sub.of("BlockStored", medium)) >= want_stored and len(sub.of("BlockRemoved", medium)) >= want_removed:
                        return
                    run(llm, [random_prompt(40, seed + i)], greedy(2))  # under a chunk: saves nothing

            run(llm, [a])
            settle(2, 0, 640)
            a_blocks = _hashes(sub.of("BlockStored", medium))
            assert len(a_blocks) == 4 and a_blocks == _hashes(sub.of("BlockStored", CPU))
            assert sub.of("BlockRemoved", medium) == []
            run(llm, [b])
            settle(4, 2, 700)
            time.sleep(0.5)
            sub.drain(0.5)
            b_blocks = _hashes(sub.of("BlockStored", medium))[4:]
            assert len(b_blocks) == 4
            assert sorted(_hashes(sub.of("BlockRemoved", medium))) == sorted(a_blocks)
            assert sub.of("BlockRemoved", CPU) == []
    finally:
        if sub is not None:
            sub.close()
        node.stop()
