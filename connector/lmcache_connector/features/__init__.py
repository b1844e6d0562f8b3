"""Decisions on top of plain loads and saves: what a lookup answers on the worker
(``hits``), whether loading a prefix beats recomputing it (``load_policy``), hits that
end inside a stored chunk (``subchunks``), and vLLM-CPU's core reservation with its
start-up advice (``cpu_cores``)."""
