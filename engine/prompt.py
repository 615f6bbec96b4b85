"""Prompt validation shared by the engine and the router (which tokenizes without a model)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError, ResourceExhaustedError


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
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            ids = self._tok().encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            ids = self._tok().apply_chat(list(prompt),
                                         specials_in_content=self.chat_special_tokens)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)")
        if -(-(len(ids) + 1) // self.block_size) > self.num_blocks:
            raise ResourceExhaustedError(f"prompt of {len(ids)} tokens exceeds the KV cache")
        return ids

    def _tok(self):
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: send token ids")
        return self.tokenizer
