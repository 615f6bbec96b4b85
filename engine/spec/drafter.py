"""What a token-only drafter offers the verifier: up to k guessed next tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod


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
