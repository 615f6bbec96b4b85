"""What every drafter offers the verifier: up to k guessed next tokens (and, optionally, q)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class DraftProposal:
    """Draft tokens and the distribution q each was drawn from.

    probs: [len(tokens), vocab], row i the exact law q that tokens[i] was *sampled* from.
    None means a point mass at each proposed token: right for deterministic drafters (n-gram,
    a draft model decoded by argmax), and lossless however the tokens were chosen, only with
    fewer acceptances than the true q would give. A q that is not the law the token was drawn
    from (e.g. a softmax passed for an argmax pick) breaks losslessness.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(ABC):
    """A token-only drafter: guesses continuations from token ids alone, with no weights."""

    @abstractmethod
    def propose(self, token_ids: list[int], k: int, seq_id: str | None = None) -> list[int]:
        """Up to k draft tokens to follow token_ids (prompt + output); fewer or none is fine.

        seq_id, when given, lets a drafter keep per-sequence state between decode steps;
        call `release(seq_id)` when the sequence finishes.
        """

    def release(self, seq_id: str) -> None:
        """Drop any state kept for seq_id (no-op for stateless drafters)."""
        return None
