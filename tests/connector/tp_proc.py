"""One tensor-parallel-2 vLLM engine (``mp`` executor, one worker process per rank) in a
fresh Python process: ``python -m tests.connector.tp_proc MODEL CONFIG_JSON|none
PROMPTS_JSON [LLM_KWARGS_JSON]``. Runs the prompts twice and prints ``RESULT {...}`` with the greedy tokens
and cached-token counts of each pass. With ``kv_events_config`` among the LLM
arguments, ``RESULT`` also holds every KV event published, read back from the
publisher's replay endpoint (``events``: ``[type, medium, block hashes]``)."""

from __future__ import annotations

import gc
import json
import os
import sys


def _replay(endpoint: str, timeout_s: float = 30.0) -> list[list]:
    """Every event batch the publisher still holds, from sequence 0 (its replay
    protocol: a DEALER asks, batches come back until the end marker)."""
    import time

    import zmq
    from msgspec.msgpack import Decoder
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    time.sleep(1.0)  # the last step's batch reaches the publisher thread
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    decoder, events = Decoder(type=KVEventBatch), []
    deadline = time.monotonic() + timeout_s
    try:
        while sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                return events
            events += [[type(e).__name__, e.medium, list(e.block_hashes)] for e in decoder.decode(payload).events]
        raise SystemExit("no end of replay from the KV event publisher")
    finally:
        sock.close(linger=0)
        ctx.term()


def main() -> int:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams
    from lmcache_connector.transfer_config import kv_transfer_config
    from vllm.inputs import TokensPrompt

    model, config, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    kw: dict = dict(
        model=model,
        enforce_eager=True,
        max_model_len=4096,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        seed=0,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=64 << 20,
    )
    if len(sys.argv) > 4:
        kw.update(json.loads(sys.argv[4]))
    if "kv_events_config" in kw:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**kw["kv_events_config"])
    if config != "none":
        kw["kv_transfer_config"] = kv_transfer_config(json.loads(config))
    gc.collect()  # vLLM's imports frozen: its collections while it builds the engine skip them
    gc.freeze()
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=8, temperature=0)
    passes = []
    for _ in range(2):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        passes.append({"tokens": [list(o.outputs[0].token_ids) for o in outs], "cached": [o.num_cached_tokens for o in outs]})
    if "kv_events_config" in kw:
        passes[0]["events"] = _replay(kw["kv_events_config"].replay_endpoint)
    print("RESULT " + json.dumps(passes), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    rc = main()
    # The engine is shut down and its results printed; what is left is the interpreter's
    # teardown of vLLM's and torch's heap, about 3 s per process: skipped.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
