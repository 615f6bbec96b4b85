"""tandem's model runtime: config, weights, paged KV cache, attention backends, sampler,
scheduler, and the Engine both node kinds share. No Ray, gRPC or UCX imports here.

The names that need torch (`Engine`, `EngineConfig`, `ModelConfig`) are imported on first use,
so that the router can import `engine.prompt` and `engine.tokenizer` without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError, ResourceExhaustedError, UnsupportedModelError
from engine.output import Completion, RequestOutput
from engine.sequence import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.engine import Engine

_LAZY = {"Engine": "engine.engine", "EngineConfig": "engine.config",
         "ModelConfig": "engine.config"}

__all__ = [
    "Completion", "Engine", "EngineConfig", "InvalidRequestError", "ModelConfig",
    "RequestOutput", "ResourceExhaustedError", "SamplingParams", "UnsupportedModelError",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
