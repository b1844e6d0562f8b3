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

    def of(self, kind: str, medium: str) -> list[Any]:
        return [e for e in self.events if type(e).__name__ == kind and e.medium == medium]

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
                run(llm, [random_prompt(130, 700 + i)], greedy(2))  # one full vLLM block, under a chunk
                sub.drain(0.2)
                if sub.events:
                    break
            assert sub.events, "the subscriber never received vLLM's own events"
            sub.events.clear()
            assert worker()._chunk_bytes == CHUNK_BYTES
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
