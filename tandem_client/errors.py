"""Errors: one `TandemError` subclass per gRPC status code a caller may want to handle apart."""

from __future__ import annotations

import grpc


class TandemError(Exception):
    """A call failed. `code` is the gRPC status code, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


class InvalidArgumentError(TandemError):
    """The request is wrong (empty prompt, bad sampling value, prompt longer than the context)."""


class ResourceExhaustedError(TandemError):
    """The server cannot take the request now (queue full) or ever (KV cache too small)."""


class UnavailableError(TandemError):
    """No server could take the request; retried automatically before any output arrived."""


class AuthenticationError(TandemError):
    """The server wants a valid bearer token (`token=`) and got none or a wrong one; never
    retried."""


class DeadlineExceededError(TandemError):
    """The call's deadline (the `timeout`) passed."""


class RequestCancelledError(TandemError):
    """The server cancelled the call (a cancel by this client ends its stream quietly)."""


class InternalError(TandemError):
    """The server failed (a bug or a lost node)."""


class UnimplementedError(TandemError):
    """The server does not implement this method (an older server)."""


_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}


def error_for(code: grpc.StatusCode, details: str = "") -> TandemError:
    """The TandemError subclass for `code` (TandemError itself for the rarer codes)."""
    return _BY_CODE.get(code, TandemError)(code, details)


def from_rpc_error(err: grpc.RpcError) -> TandemError:
    """Translate a grpc error (sync or aio; both are grpc.Call objects) into a TandemError."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "")
