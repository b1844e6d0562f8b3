"""What the demo, the tests and the benchmarks hand vLLM, in one place: the
``KVTransferConfig`` that puts lmcache-core into an engine, and token prompts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


def kv_transfer_config(
    extra: dict[str, Any] | None = None,
    role: Literal["kv_producer", "kv_both", "kv_consumer"] = "kv_both",
    **overrides: Any,
) -> KVTransferConfig:
    """lmcache-core's connector with ``extra`` as its configuration
    (``kv_connector_extra_config``) and a failed load recomputed rather than failing
    the request; ``overrides`` go to ``KVTransferConfig`` as they are."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="LMCacheCoreConnector",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra or {}),
        **overrides,
    )


def tokens_prompt(ids: list[int]) -> Any:
    """vLLM's TokensPrompt (its optional keys are NotRequired from typing, which type
    checkers for Python 3.10 read as required: built here once)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)  # type: ignore[typeddict-item]
