"""Several engines on one node: warm TTFT through a node-local ``lmcache-core serve``
node against the engine's own CPU tier, and one chunk's load over loopback TCP
against a plain memcpy of the chunk, side by side in one run.

* chunk load: ``PeerBackend.get`` of one chunk from the node (authenticated, framed,
  checksummed, copied into the output tensor), the way the engine reads it, against
  ``torch.Tensor.copy_`` of the same bytes (the bar for a same-host fast path: 0.7);
* warm TTFT, own CPU tier: one engine process computes the prompts, then asks again
  (loads from its CPU tier);
* warm TTFT, node: engine A pushes what it computes to the node and keeps nothing;
  a fresh engine B (empty CPU tier) asks the same prompts and loads through the node;
* cold TTFT (the first pass of the CPU-tier engine) for scale.

    python bench/bench_node_ttft.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SPEC_KW = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408, vocab_size=4096)


def child(model: str, config: dict[str, Any] | None, prompts: list[list[int]], passes: int) -> None:
    """One vLLM process: TTFT of each prompt per pass, as a JSON line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from lmcache_connector.transfer_config import kv_transfer_config
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        enforce_eager=True,
        dtype="float32",
        max_model_len=8192,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config=kv_transfer_config(config),
    )
    from bench_disk_ttft import ttft

    llm.generate([TokensPrompt(prompt_token_ids=[5] * 32)], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up, no reuse
    out: list[dict[str, Any]] = []
    for _ in range(passes):
        times, cached = ttft(llm, prompts)
        out.append({"times": times, "cached": cached})
    get_kv_transfer_group()._worker.engine.flush(120)
    print("RESULT " + json.dumps(out), flush=True)
    llm.llm_engine.engine_core.shutdown()


def run_child(model: Path, config: dict[str, Any], prompts: list[list[int]], passes: int) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"config": config, "prompts": prompts, "passes": passes}, f)
    proc = subprocess.run([sys.executable, __file__, "--child", str(model), f.name], capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"engine process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def start_node(tmp: Path, max_size: str) -> tuple[subprocess.Popen, str, Path]:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_peer import first_line

    secret = tmp / "secret"
    secret.write_text(os.urandom(24).hex())
    exe = shutil.which("lmcache-core", path=os.path.dirname(sys.executable)) or "lmcache-core"
    proc = subprocess.Popen(
        [exe, "serve", "--listen", "127.0.0.1:0", "--secret-file", str(secret), "--max-size", max_size],
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, first_line(proc).removeprefix("listening on "), secret


def chunk_load(address: str, secret: Path, nbytes: int, rounds: int) -> tuple[float, float]:
    """Median seconds: (memcpy of one chunk, PeerBackend.get of it from the node)."""
    import torch

    from lmcache_backend_peer import PeerClient, create_peer_backend
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.serde import RawCodec, encode
    from lmcache_core.testing import make_context

    host, port = address.rsplit(":", 1)
    key = KeyNamespace(model="bench-node").key(os.urandom(16))
    src = torch.randn(nbytes // 4)
    pusher = PeerClient((host, int(port)), secret.read_text().encode(), timeout=30)
    assert pusher.put(key, encode(key, src, RawCodec()))
    pusher.close()
    backend = create_peer_backend(
        {"peers": [address], "secret_file": str(secret), "max_size": 0, "timeout_ms": 30_000}, make_context(pool_bytes=1 << 20)
    )
    out, dst = torch.zeros_like(src), torch.zeros_like(src)  # pages touched before timing
    torch.set_num_threads(1)  # a plain memcpy is one thread (and the peer client copies on one)
    copy_t, get_t = [], []
    try:
        assert backend.get(key, out)  # connection warm
        for _ in range(rounds):  # interleaved: load on the machine hits both alike
            t = time.perf_counter()
            dst.copy_(src)
            copy_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            if not backend.get(key, out):
                raise SystemExit("node get missed")
            get_t.append(time.perf_counter() - t)
        if not torch.equal(out, src):
            raise SystemExit("node returned wrong bytes")
    finally:
        backend.close()
    return statistics.median(copy_t), statistics.median(get_t)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        job = json.loads(Path(sys.argv[3]).read_text())
        child(sys.argv[2], job["config"], job["prompts"], job["passes"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts x 2048 tokens, 20 chunk rounds")
    args = ap.parse_args()
    from lmcache_connector.tiny_model import TinyModelSpec, build_tiny_model, random_prompt

    spec = TinyModelSpec(**SPEC_KW)
    model = build_tiny_model(Path.home() / ".cache" / "lmcache-core" / spec.tag(), spec)
    n, tokens, rounds = (2, 2048, 20) if args.quick else (4, 4096, 50)
    prompts = [random_prompt(tokens, 900 + i, spec.vocab_size) for i in range(n)]
    chunk_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 256 * 4
    tmp = Path(tempfile.mkdtemp(prefix="lmcache-node-ttft-"))
    node, address, secret = start_node(tmp, "2GiB")
    try:
        copy_s, get_s = chunk_load(address, secret, chunk_bytes, rounds)
        print(
            f"model {spec.tag()} (float32), {n} prompts x {tokens} tokens, chunk {chunk_bytes >> 10} KiB; node {address}",
            flush=True,
        )
        own = run_child(model, {"backends": [{"name": "local_cpu", "max_size": "1GiB"}]}, prompts, 2)
        peer = {"name": "peer", "peers": [address], "secret_file": str(secret), "push": True, "max_size": 0}
        via_node = {"backends": [{"name": "local_cpu", "max_size": "1GiB"}, peer]}
        run_child(model, via_node, prompts, 1)  # engine A: computes, pushes to the node
        b = run_child(model, via_node, prompts, 1)[0]  # engine B: fresh, loads through the node
    finally:
        node.kill()
        node.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    cold, warm = own
    med = {k: statistics.median(v["times"]) for k, v in (("cold", cold), ("cpu", warm), ("node", b))}
    print(f"\n{'path':<34}{'TTFT ms (median)':>18}{'cached tok':>12}")
    print(f"{'cold (recompute + save)':<34}{med['cold'] * 1000:>18.1f}{int(statistics.median(cold['cached'])):>12}")
    print(f"{'warm, own CPU tier':<34}{med['cpu'] * 1000:>18.1f}{int(statistics.median(warm['cached'])):>12}")
    print(f"{'warm, through the serve node':<34}{med['node'] * 1000:>18.1f}{int(statistics.median(b['cached'])):>12}")
    print(f"node / own CPU tier warm TTFT: {med['node'] / med['cpu']:.2f}x; own CPU tier / cold: {med['cpu'] / med['cold']:.2f}x")
    ratio = copy_s / get_s
    print(
        f"\none chunk ({chunk_bytes >> 10} KiB): memcpy {copy_s * 1e6:.0f} us ({chunk_bytes / copy_s / 1e9:.2f} GB/s), "
        f"node get over loopback TCP {get_s * 1e6:.0f} us ({chunk_bytes / get_s / 1e9:.2f} GB/s)"
    )
    print(
        f"node get / memcpy throughput: {ratio:.2f} (bar for a same-host fast path: 0.70) -> {'met' if ratio >= 0.7 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
