"""Loggers for the connector, as children of vLLM's ``vllm`` logger so its lines
(the start-up summary, warnings about bad requests or failed loads) appear in vLLM's
own log with its format and level."""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    return logging.getLogger("vllm.lmcache." + module.rsplit(".", 1)[-1])
