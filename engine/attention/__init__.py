"""Attention backends behind one interface; pick one by name."""

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_ref import TorchAttention
from engine.attention.triton_backend import TritonAttention, triton_available

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention, "triton": TritonAttention}


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`; a clear error for unknown names."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; have {sorted(BACKENDS)}") from None


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttention", "TritonAttention",
           "get_backend", "triton_available"]
