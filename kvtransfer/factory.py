"""Build a transport by name, so nodes take plain config."""

from __future__ import annotations

from typing import Any

import torch

from kvtransfer.base import Transport
from kvtransfer.layout import BlockLayout


def make_transport(kind: str, layout: BlockLayout, kv_cache: torch.Tensor | None = None,
                   **kwargs: Any) -> Transport:
    """'ucx' (worker addresses: shared memory on one host), 'ucx-tcp' (listener) or 'local'."""
    if kind == "local":
        from kvtransfer.local import LocalTransport

        return LocalTransport(layout, kv_cache)
    if kind in ("ucx", "ucx-tcp"):
        from kvtransfer.ucx import UcxTransport

        mode = "worker" if kind == "ucx" else "listener"
        return UcxTransport(layout, kv_cache, mode=mode, **kwargs)
    raise ValueError(f"unknown transport {kind!r}: use 'ucx', 'ucx-tcp' or 'local'")
