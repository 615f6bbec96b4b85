"""Errors the engine raises for requests it cannot serve; nodes map them to gRPC status codes."""

import re

# A prompt past the context: the message travels as a gRPC status's text, which the OpenAI
# door reads (CONTEXT_FULL) to answer with OpenAI's context_length_exceeded code.
CONTEXT_FULL = re.compile(r"prompt has \d+ tokens; the context holds \d+ ")


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad sampling params, empty prompt, ...): INVALID_ARGUMENT."""


class ResourceExhaustedError(RuntimeError):
    """Valid, but can never fit this engine (KV blocks, context): RESOURCE_EXHAUSTED."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or a feature of it is not implemented."""


def context_full(tokens: int, max_model_len: int) -> InvalidRequestError:
    """The error for a prompt of `tokens` ids that leaves no room to generate one token."""
    return InvalidRequestError(f"prompt has {tokens} tokens; the context holds {max_model_len} "
                               "(prompt plus at least one generated token)")
