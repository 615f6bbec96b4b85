"""Token selection: greedy, temperature, top-k, top-p; each request draws from its own RNG."""

from __future__ import annotations

import random

import torch

from engine.sequence import SamplingParams


def new_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's private RNG: seeded → reproducible whatever else is in the batch."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else random.getrandbits(63))
    return g


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: temperature, then top-k, then top-p.

    logits: [n, vocab] fp32 (n positions of one request). Speculative verification uses the
    same function, so draft acceptance tests against exactly what plain sampling would use.
    """
    logits = logits.float() / max(params.temperature, 1e-6)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs ([n, vocab]) by the exponential race (no host sync needed)."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


class Sampler:
    """Picks the next token of each request from its logits row."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        greedy = logits.argmax(dim=-1)
        out = greedy.tolist()
        for i, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:
                out[i] = int(sample_from(processed_probs(logits[i : i + 1], p), g)[0])
        return out
