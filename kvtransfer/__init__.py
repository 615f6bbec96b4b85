"""Moving KV blocks between engines: the Transport interface and its implementations.

`LocalTransport` (one process) is imported eagerly; `UcxTransport` lazily, so the engine and the
colocated mode never need ucxx.
"""

import os
from typing import Any

# UCX reads its environment when ucxx loads it; every kvtransfer import runs this first.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from kvtransfer.base import (  # noqa: E402
    MAX_REQUEST_ID_BYTES,
    Connection,
    Extras,
    LoopThread,
    RequestTooLarge,
    TransferError,
    TransferStats,
    Transport,
    check_request_id,
)
from kvtransfer.layout import BlockLayout, LayoutMismatch, check_compatible  # noqa: E402
from kvtransfer.local import LocalTransport  # noqa: E402

__all__ = ["MAX_REQUEST_ID_BYTES", "BlockLayout", "Connection", "Extras", "LayoutMismatch",
           "LocalTransport", "LoopThread", "RequestTooLarge", "TransferError", "TransferStats",
           "Transport", "UcxTransport", "check_compatible", "check_request_id"]


def __getattr__(name: str) -> Any:
    if name == "UcxTransport":
        from kvtransfer.ucx import UcxTransport

        return UcxTransport
    raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
