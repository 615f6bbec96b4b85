"""The state that moves with a request from a prefill engine to a decode engine, besides its
KV blocks: enough for the decode side to continue exactly as one engine would have."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from engine.sequence import SamplingParams


@dataclass
class Handoff:
    """Plain data (picklable, JSON-able but for `rng_state`), built by `Engine.export_handoff`
    on the prefill side and consumed by `Engine.admit` on the decode side."""

    request_id: str
    token_ids: list[int]  # prompt + the first generated token
    num_prompt_tokens: int
    num_computed: int  # positions whose KV ships in the blocks (target and draft layers)
    params: dict
    cached_tokens: int = 0
    rng_state: bytes | None = None  # the request's sampler RNG after the first token
    text: str = ""  # detokenized output so far, and how much of it was streamed
    num_emitted_chars: int = 0
    detok_offsets: tuple[int, int] | None = None
    draft: list[int] = field(default_factory=list)  # drafts the first decode step verifies
    draft_q: torch.Tensor | None = None  # their draft distributions when sampled [K, vocab]
    max_draft: int | None = None  # the request's own cap on drafts per step
    # The EAGLE-3 head's hidden state at the last prompt position (built from the fused target
    # features): with no drafts above, the decode side drafts from it itself.
    hidden: torch.Tensor | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(**self.params)

    @staticmethod
    def params_dict(p: SamplingParams) -> dict:
        return asdict(p)
