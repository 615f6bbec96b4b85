"""Errors the engine raises for requests it cannot serve; nodes map them to gRPC status codes."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad sampling params, empty prompt, ...): INVALID_ARGUMENT."""


class ResourceExhaustedError(RuntimeError):
    """Valid, but can never fit this engine (KV blocks, context): RESOURCE_EXHAUSTED."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or a feature of it is not implemented."""
