"""Moving a step's chunks between vLLM's paged KV tensors and the cache: one object
per layout (``chunks``: ``DenseTransfers``, ``GroupedTransfers``) and the strategies
it owns: loads and saves on background threads (``async_loads``, ``async_saves``,
sharing ``transfer_queue``) or layer by layer on a side CUDA stream (``layerwise``)."""
