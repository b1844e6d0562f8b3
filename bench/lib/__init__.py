"""What the benchmarks in ``bench/`` share, so that no benchmark imports another.

- ``servers``: the processes a benchmark starts beside itself (moto's S3, a
  ``redis-server``, an ``lmcache-core serve`` or ``lmcache-peer-serve`` node), each
  with bounded waits;
- ``openai_server``: vLLM's OpenAI server as the unit under test (start, stop, the
  processes its tiers need, what its processes use); ``openai_client``: prompts and
  streamed requests with the client's first-token and inter-token times;
- ``divergence``: two servers' greedy answers judged by their logprobs (identical,
  a near-tie at the first differing token, or a real mismatch);
- ``vllm_engine``: one in-process vLLM engine per system (recompute, vLLM's example
  connector, lmcache-core, vLLM's prefix cache), its TTFT and shutdown;
- ``ttft_engine``: one engine per child process, for the fresh-process TTFT benchmarks;
- ``latency_proxy``: the network the remote-tier benchmarks run through;
- ``options``: command-line options several benchmarks share;
- ``timing``: median seconds of a call (CPU clock or CUDA events), and dropping the
  page cache before a cold read.

A benchmark run as ``python bench/bench_X.py`` has ``bench/`` first on ``sys.path``,
so it imports these as ``from lib import servers``.
"""
