"""How the connector sees vLLM's KV caches: the layout adapters for one KV-cache
group (``kv_adapters``: block and token layouts), vLLM's KV-cache groups and what each
kind stores (``groups``), and the adapter for several groups, hybrid models
(``grouped_layout``)."""
