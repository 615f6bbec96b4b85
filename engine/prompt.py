"""Prompt validation shared by the engine and the router (which tokenizes without a model)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from engine.errors import InvalidRequestError, ResourceExhaustedError, context_full
from engine.sequence import integer


@dataclass
class PromptEncoder:
    """Text, chat messages or token ids → validated token ids for one engine's limits."""

    tokenizer: object | None  # engine.tokenizer.Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # the smallest KV cache a request may land in
    # special-token strings in chat content read as the tokens (trusted callers), not as text
    chat_special_tokens: bool = False

    def __call__(self, prompt: str | list[int] | list[dict]) -> list[int]:
        if hasattr(prompt, "tolist") and not isinstance(prompt, list):  # numpy, torch
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            ids = self._tok().encode(unicode_text(prompt, "the prompt"))
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            ids = self._tok().apply_chat(chat_messages(prompt),
                                         specials_in_content=self.chat_special_tokens)
        else:
            ids = token_ids(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise context_full(len(ids), self.max_model_len)
        if -(-(len(ids) + 1) // self.block_size) > self.num_blocks:
            raise ResourceExhaustedError(f"prompt of {len(ids)} tokens exceeds the KV cache")
        return ids

    def _tok(self):
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: send token ids")
        return self.tokenizer


def is_one_prompt(prompts) -> bool:
    """Whether `generate`'s argument is one prompt (text, token ids or a conversation), not a
    list of them."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, list):  # numpy, torch
        return getattr(prompts, "ndim", 1) <= 1
    if isinstance(prompts, (str, dict)):  # (a lone message dict: refused as a prompt)
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and (
        isinstance(prompts[0], (numbers.Integral, dict)) or getattr(prompts[0], "ndim", 1) == 0)


def token_ids(prompt) -> list[int]:
    """A token-id prompt as ints (`integer`'s: never bools, floats or strings)."""
    if isinstance(prompt, (str, bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise InvalidRequestError(f"a prompt is text, token ids or chat messages, got "
                                  f"{prompt!r:.60}")
    return [integer("a token id", t) for t in prompt]


def chat_messages(messages) -> list[dict]:
    """Chat messages checked: each a dict with a string role and content (content may be a
    list of text parts, joined)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"message {i} must be a dict with a string 'role', got "
                                      f"{m!r:.60}")
        content = m.get("content")
        if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequestError(f"message {i}: content must be a string or a list of "
                                      f"text parts, got {content!r:.60}")
        out.append({**m, "content": unicode_text(content, f"message {i}'s content")})
    return out


def unicode_text(text: str, what: str) -> str:
    """`text`, refused where it holds a lone surrogate (half of a UTF-16 pair, as JSON's
    escapes and Python strings can spell): no tokenizer encodes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} holds a lone surrogate at character {e.start}: it "
                                  "is no Unicode text") from None
    return text
