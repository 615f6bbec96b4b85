"""Python arguments → GenerateRequest. Shapes and what the wire cannot carry (a negative count, a
lone surrogate) are refused here, naming the argument; the server validates values."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from tandem_client.types import SEEDS, SPECULATION, Message, SpeculationMethod
from tandem_proto.v1 import generation_pb2 as pb


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """A value protobuf refuses (out of its field's range, a lone surrogate, a wrong type) as
    a ValueError / TypeError that names the argument, not protobuf's bare message."""
    try:
        yield
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None
    except ValueError as e:  # UnicodeEncodeError included
        raise ValueError(f"{name}: {e}") from None


def prompt_request(prompt: str | None, messages: Sequence[Message] | None,
                   token_ids: Sequence[int] | None) -> pb.GenerateRequest:
    """A GenerateRequest holding the `prompt` oneof: exactly one of text, chat or token ids."""
    given = [name for name, v in (("prompt", prompt), ("messages", messages),
                                  ("token_ids", token_ids)) if v is not None]
    if len(given) != 1:
        raise TypeError("give exactly one of prompt, messages or token_ids, "
                        f"got {', '.join(given) or 'none'}")
    if prompt is not None:
        if not isinstance(prompt, str):  # a list here is almost surely token ids or messages
            raise TypeError(f"prompt must be a str, not {type(prompt).__name__}; "
                            "use messages= or token_ids=")
        with named("prompt"):
            return pb.GenerateRequest(text=prompt)
    if messages is not None:
        chat = []
        for i, m in enumerate(messages):
            try:
                role, content = m["role"], m["content"]
            except (KeyError, TypeError) as e:
                raise TypeError('messages must be mappings with "role" and "content"') from e
            with named(f"messages[{i}]"):
                chat.append(pb.ChatMessage(role=role, content=content))
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=chat))
    with named("token_ids"):
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(token_ids or ())))


def sampling_params(*, temperature: float | None, top_p: float | None, top_k: int | None,
                    seed: int | None, max_tokens: int | None, stop: str | Sequence[str] | None,
                    stop_token_ids: Sequence[int] | None, ignore_eos: bool | None
                    ) -> pb.SamplingParams:
    """SamplingParams with only the given fields set: the rest keep the server's defaults."""
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(seed, int) and not isinstance(seed, bool) and -(1 << 63) <= seed < 0:
        seed %= SEEDS
    fields: dict[str, Any] = {
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
        "max_tokens": max_tokens, "stop": stop, "stop_token_ids": stop_token_ids,
        "ignore_eos": ignore_eos}
    out = pb.SamplingParams()
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, bool) and name != "ignore_eos":  # True would travel as 1
            raise TypeError(f"{name} must be a number, not a bool")
        with named(name):
            out.MergeFrom(pb.SamplingParams(**{name: value}))
    return out


def speculation(method: SpeculationMethod | None, num_tokens: int | None) -> pb.Speculation | None:
    """The per-request speculation override, or None to leave the deployment's default."""
    if method is None and num_tokens is None:
        return None
    if method is not None and method not in SPECULATION:
        raise ValueError(f"speculation must be one of {sorted(SPECULATION)}, got {method!r}")
    spec = pb.Speculation(method=SPECULATION[method or "default"])
    if num_tokens is not None:
        if isinstance(num_tokens, bool):
            raise TypeError("num_speculative_tokens must be an integer, not a bool")
        with named("num_speculative_tokens"):
            spec.num_tokens = num_tokens
    return spec
