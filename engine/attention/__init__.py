"""Attention backends behind one interface; pick one by name."""

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_ref import TorchAttention

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`; a clear error for unknown names."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; have {sorted(BACKENDS)}") from None


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttention", "get_backend"]
