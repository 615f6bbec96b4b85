"""Bounds on every field of the public API, checked before any work, and short, inert error
details and log fields going back out. Each limit names its field in the INVALID_ARGUMENT
error and echoed values are clipped, so a request cannot forge or bloat its refusal."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine import InvalidRequestError

MAX_DETAIL_CHARS = 300  # an error's details, as sent to the caller
ECHO_CHARS = 40  # at most this much of a caller's value is echoed in an error
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # terminal colour and cursor codes


@dataclass(frozen=True)
class Limits:
    """The documented bounds of `tandem.v1.GenerateRequest` (proto/tandem/v1/generation.proto).
    `max_prompt_chars` bounds text and chat content together, before tokenizing."""

    # room for the suffixes of moved and continued attempts: kvtransfer carries 256 bytes
    max_request_id_bytes: int = 192
    max_prompt_chars: int = 256 * 1024
    max_chat_messages: int = 512
    max_role_chars: int = 32
    max_token_ids: int = 1 << 20  # token_ids and continuation (the context is smaller still)
    max_stop_strings: int = 16
    max_stop_chars: int = 512
    max_stop_token_ids: int = 64

    def check(self, req) -> None:
        """INVALID_ARGUMENT for the first field of `req` (a GenerateRequest) over its bound."""
        self._request_id(req.request_id)
        kind = req.WhichOneof("prompt")
        if kind == "text":
            _at_most("text", len(req.text), self.max_prompt_chars, "characters")
        elif kind == "chat":
            self._chat(req.chat.messages)
        elif kind == "token_ids":
            _at_most("token_ids", len(req.token_ids.ids), self.max_token_ids, "ids")
        s = req.sampling
        _at_most("sampling.stop", len(s.stop), self.max_stop_strings, "strings")
        for i, stop in enumerate(s.stop):
            _at_most(f"sampling.stop[{i}]", len(stop), self.max_stop_chars, "characters")
        _at_most("sampling.stop_token_ids", len(s.stop_token_ids), self.max_stop_token_ids,
                 "ids")
        if req.HasField("continuation"):
            _at_most("continuation.token_ids", len(req.continuation.token_ids),
                     self.max_token_ids, "ids")

    def _request_id(self, rid: str) -> None:
        _at_most("request_id", len(rid.encode()), self.max_request_id_bytes, "bytes")
        if not rid.isprintable():
            raise InvalidRequestError("request_id holds control or non-printable characters")

    def _chat(self, messages) -> None:
        _at_most("chat.messages", len(messages), self.max_chat_messages, "messages")
        total = 0
        for i, m in enumerate(messages):
            _at_most(f"chat.messages[{i}].role", len(m.role), self.max_role_chars, "characters")
            total += len(m.content)
        _at_most("chat content", total, self.max_prompt_chars, "characters in all")


def _at_most(field: str, n: int, limit: int, unit: str) -> None:
    if n > limit:
        raise InvalidRequestError(f"{field} has {n} {unit}; the limit is {limit}")


def clip(value: object, n: int = ECHO_CHARS) -> str:
    """`value` as a short, inert string to echo: repr-escaped (no newlines or control
    characters survive), cut to about `n` characters."""
    return _cut(repr(value) if isinstance(value, str) else repr(str(value)), n)


def shown(value: object, n: int = ECHO_CHARS) -> str:
    """A JSON value of a request as its JSON text, ASCII-escaped and cut to about `n`
    characters: 2.0 echoes as 2.0 and "5" as "5", not quoted again as `clip` quotes."""
    try:
        return _cut(json.dumps(value, ensure_ascii=True), n)
    except (TypeError, ValueError):  # not JSON's: (no request value)
        return clip(value, n)


def detail(message: str) -> str:
    """An error's details as sent to a caller: one line, printable, at most
    `MAX_DETAIL_CHARS` characters."""
    flat = "".join(c if c.isprintable() else " " for c in _ANSI.sub("", message))
    return _cut(" ".join(flat.split()), MAX_DETAIL_CHARS)


def _cut(s: str, n: int) -> str:
    """s, or its first n - 1 characters and an ellipsis."""
    return s if len(s) <= n else s[: n - 1] + "…"
