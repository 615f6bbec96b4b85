"""Moving KV blocks between engines: the Transport interface and its implementations.

`LocalTransport` (one process) is imported eagerly; `UcxTransport` lazily, so the engine and the
colocated mode never need ucxx.
"""

import os
from typing import Any

# UCX reads its environment when ucxx loads it; every kvtransfer import runs this first.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from kvtransfer.base import (  # noqa: E402
    Connection,
    Extras,
    LoopThread,
    TransferError,
    TransferStats,
    Transport,
)
from kvtransfer.layout import BlockLayout, LayoutMismatch, check_compatible  # noqa: E402
from kvtransfer.local import LocalTransport  # noqa: E402

__all__ = ["BlockLayout", "Connection", "Extras", "LayoutMismatch", "LocalTransport",
           "LoopThread", "TransferError", "TransferStats", "Transport", "UcxTransport",
           "check_compatible"]


def __getattr__(name: str) -> Any:
    if name == "UcxTransport":
        from kvtransfer.ucx import UcxTransport

        return UcxTransport
    raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
