"""The tandem Python SDK (gRPC; depends only on grpcio and protobuf).

    from tandem_client import Client

    with Client("localhost:50051", timeout=60) as client:
        for chunk in client.generate("Once upon a time", max_tokens=64, temperature=0.8):
            print(chunk.text, end="", flush=True)
        reply = client.chat([{"role": "user", "content": "Name three colours."}])
        print(reply.text, reply.usage)

`AsyncClient` is the same API on asyncio. Failures raise a `TandemError` subclass carrying the
gRPC status code. With TLS and bearer tokens: `Client(target, tls=TLS(ca="ca.pem"),
token="...")` (`TLS(cert=..., key=...)` for mTLS). Stubs: `tandem_proto.v1`
(`python tools/gen_proto.py`).
"""

from tandem_client.aio import AsyncClient, AsyncStream
from tandem_client.client import Client, Stream
from tandem_client.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    RequestCancelledError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
    UnimplementedError,
)
from tandem_client.security import TLS
from tandem_client.types import Chunk, Completion, FinishReason, Message, ModelInfo, Usage

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "FinishReason",
    "InternalError",
    "InvalidArgumentError",
    "Message",
    "ModelInfo",
    "RequestCancelledError",
    "ResourceExhaustedError",
    "Stream",
    "TLS",
    "TandemError",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
]
