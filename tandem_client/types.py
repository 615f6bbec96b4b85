"""What the SDK hands back: plain frozen dataclasses, so callers never touch protobuf objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from tandem_proto.v1 import generation_pb2 as pb

FinishReason = Literal["stop", "length", "cancelled", "error"]
SpeculationMethod = Literal["default", "none", "eagle3", "ngram"]
Message = Mapping[str, str]
"""One chat turn: {"role": "user", "content": "..."} (OpenAI style)."""
SEEDS = 1 << 63  # the server's seeds are [0, SEEDS): a signed 64-bit one is taken modulo it

_FINISH: dict[int, FinishReason | None] = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}
SPECULATION: dict[SpeculationMethod, pb.SpeculationMethod] = {
    "default": pb.SPECULATION_METHOD_UNSPECIFIED,
    "none": pb.SPECULATION_METHOD_NONE,
    "eagle3": pb.SPECULATION_METHOD_EAGLE3,
    "ngram": pb.SPECULATION_METHOD_NGRAM,
}


@dataclass(frozen=True)
class Usage:
    """Token accounting and timing of one request (sent with its last chunk)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    accepted_draft_tokens: int  # generated tokens that were accepted speculative drafts
    ttft_ms: float  # time to first token, measured by the server

    @classmethod
    def from_pb(cls, u: pb.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                   u.accepted_draft_tokens, u.ttft_ms)


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a completion: the text and tokens new since the previous chunk."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None  # set on the last chunk only
    usage: Usage | None = None  # set on the last chunk only
    request_id: str = ""

    @classmethod
    def from_pb(cls, r: pb.GenerateResponse) -> Chunk:
        # An unknown enum value (a newer server) still means "finished": report it as an error
        # rather than as "not finished", which would make a caller wait for more.
        reason = _FINISH.get(r.finish_reason, "error")
        usage = Usage.from_pb(r.usage) if r.HasField("usage") else None
        return cls(r.text, tuple(r.token_ids), reason, usage, r.request_id)


@dataclass(frozen=True)
class Completion:
    """A whole completion: the chunks of one stream joined."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None  # None only if the stream ended without a last chunk
    usage: Usage | None
    request_id: str

    @classmethod
    def join(cls, chunks: Iterable[Chunk]) -> Completion:
        """Concatenate the deltas; the finish reason and usage come from the last chunk."""
        chunks = list(chunks)
        last = chunks[-1] if chunks else Chunk("", ())
        return cls("".join(c.text for c in chunks), tuple(t for c in chunks for t in c.token_ids),
                   last.finish_reason, last.usage, last.request_id)


@dataclass(frozen=True)
class ModelInfo:
    """The served model."""

    model: str
    vocab_size: int
    max_model_len: int
    default_speculation: SpeculationMethod
    block_size: int
    dtype: str
    deterministic: bool = False  # bit-identical output whatever shares the server (see proto)

    @classmethod
    def from_pb(cls, m: pb.ModelInfo) -> ModelInfo:
        spec: SpeculationMethod = next(
            (k for k, v in SPECULATION.items() if v == m.default_speculation), "default")
        return cls(m.model, m.vocab_size, m.max_model_len, spec, m.block_size, m.dtype,
                   m.deterministic)
