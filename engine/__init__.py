"""tandem's model runtime: config, weights, paged KV cache, attention backends, sampler,
scheduler, and the Engine both node kinds share. No Ray, gRPC or UCX imports here."""

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError, ResourceExhaustedError, UnsupportedModelError
from engine.output import Completion, RequestOutput
from engine.sequence import SamplingParams

__all__ = [
    "Completion", "Engine", "EngineConfig", "InvalidRequestError", "ModelConfig",
    "RequestOutput", "ResourceExhaustedError", "SamplingParams", "UnsupportedModelError",
]
