"""What crosses vLLM's process boundaries, in vLLM's own protocol objects: the
per-step plan the scheduler side sends the workers (``metadata``), the
scheduler-to-worker lookups over ZeroMQ IPC (``lookup_ipc``), the tiers' stores and
evictions as vLLM KV events (``kv_events``) and the connector metrics vLLM ships to
its front end (``stats``)."""
