"""Public request messages → engine inputs, validating as we go (errors → INVALID_ARGUMENT)."""

from __future__ import annotations

from engine import InvalidRequestError, SamplingParams
from router.limits import clip
from tandem_proto.v1 import generation_pb2 as pb

SPEC_NAMES = {pb.SPECULATION_METHOD_NONE: "none", pb.SPECULATION_METHOD_EAGLE3: "eagle3",
              pb.SPECULATION_METHOD_NGRAM: "ngram"}
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
          "cancelled": pb.FINISH_REASON_CANCELLED, "error": pb.FINISH_REASON_ERROR}
DEFAULT_MAX_TOKENS = 256


def prompt_of(req: pb.GenerateRequest) -> str | list[dict] | list[int]:
    """The prompt as the engine takes it: text, chat messages or token ids."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("no prompt: set one of text, chat, token_ids")
    if kind == "text":
        return req.text
    if kind == "chat":
        msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        if not msgs:
            raise InvalidRequestError("chat has no messages")
        bad = sorted({m["role"] for m in msgs} - {"system", "user", "assistant", "tool"})
        if bad:
            raise InvalidRequestError(f"unknown chat role {clip(bad[0])} (system, user, "
                                      "assistant or tool)")
        return msgs
    return list(req.token_ids.ids)


def sampling_of(req: pb.GenerateRequest) -> SamplingParams:
    """SamplingParams from the message; unset fields take the server defaults."""
    s = req.sampling
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)


def continuation_of(req: pb.GenerateRequest, params: SamplingParams
                    ) -> tuple[list[int], int] | None:
    """(token ids already streamed, characters of their text already streamed) of a request
    that continues a broken call, or None for a new one. The ids' range and the context length
    are checked with the prompt (the engine's encoder)."""
    if not req.HasField("continuation"):
        return None
    ids = list(req.continuation.token_ids)
    if not ids:
        raise InvalidRequestError("continuation has no token ids")
    if len(ids) >= params.max_tokens:
        raise InvalidRequestError(f"continuation has {len(ids)} tokens: nothing is left of "
                                  f"max_tokens={params.max_tokens}")
    return ids, req.continuation.text_length


def spec_cap_of(req: pb.GenerateRequest, served: str) -> int | None:
    """Per-request cap on draft tokens (None: the server's choice); refuses a method this
    deployment does not serve."""
    if not req.HasField("speculation"):
        return None
    sp = req.speculation
    if sp.method not in (pb.SPECULATION_METHOD_UNSPECIFIED, *SPEC_NAMES):
        raise InvalidRequestError(f"unknown speculation method {sp.method}")
    method = SPEC_NAMES.get(sp.method, served)
    if method == "none":
        return 0
    if method != served:
        raise InvalidRequestError(f"this deployment speculates with {served!r}, not {method!r}")
    return sp.num_tokens if sp.HasField("num_tokens") else None
