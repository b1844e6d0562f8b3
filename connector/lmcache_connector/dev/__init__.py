"""Dev tooling, no part of serving: the ``lmcache-core demo`` command (``demo``) and
the small local models the demo, the tests and the benchmarks run (``tiny_model``,
``tiny_hybrid``). Nothing here imports vLLM at import time."""
