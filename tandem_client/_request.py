"""Python arguments → GenerateRequest. Only shape is checked here; the server validates values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem_client.types import SPECULATION, Message, SpeculationMethod
from tandem_proto.v1 import generation_pb2 as pb


def prompt_fields(prompt: str | None, messages: Sequence[Message] | None,
                  token_ids: Sequence[int] | None) -> dict:
    """The `prompt` oneof: exactly one of text, chat or token ids."""
    given = [name for name, v in (("prompt", prompt), ("messages", messages),
                                  ("token_ids", token_ids)) if v is not None]
    if len(given) != 1:
        raise TypeError("give exactly one of prompt, messages or token_ids, "
                        f"got {', '.join(given) or 'none'}")
    if prompt is not None:
        if not isinstance(prompt, str):  # a list here is almost surely token ids or messages
            raise TypeError(f"prompt must be a str, not {type(prompt).__name__}; "
                            "use messages= or token_ids=")
        return {"text": prompt}
    if messages is not None:
        try:
            chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        except (KeyError, TypeError) as e:
            raise TypeError('messages must be mappings with "role" and "content"') from e
        return {"chat": pb.ChatMessages(messages=chat)}
    return {"token_ids": pb.TokenIds(ids=list(token_ids or ()))}


def sampling_params(*, temperature: float | None, top_p: float | None, top_k: int | None,
                    seed: int | None, max_tokens: int | None, stop: str | Sequence[str] | None,
                    stop_token_ids: Sequence[int] | None, ignore_eos: bool | None
                    ) -> pb.SamplingParams:
    """SamplingParams with only the given fields set: the rest keep the server's defaults."""
    if isinstance(stop, str):
        stop = [stop]
    fields: dict[str, Any] = {
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
        "max_tokens": max_tokens, "stop": stop, "stop_token_ids": stop_token_ids,
        "ignore_eos": ignore_eos}
    return pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


def speculation(method: SpeculationMethod | None, num_tokens: int | None) -> pb.Speculation | None:
    """The per-request speculation override, or None to leave the deployment's default."""
    if method is None and num_tokens is None:
        return None
    if method is not None and method not in SPECULATION:
        raise ValueError(f"speculation must be one of {sorted(SPECULATION)}, got {method!r}")
    spec = pb.Speculation(method=SPECULATION[method or "default"])
    if num_tokens is not None:
        spec.num_tokens = num_tokens
    return spec
