"""Acceptance counters of speculative decoding, ready for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.verify import VerifyResult


@dataclass
class SpecStats:
    """Acceptance counters, ready for metrics."""

    k_max: int
    verify_steps: int = 0  # target forwards that carried drafts (per sequence)
    emitted: int = 0  # tokens those forwards produced (accepted + the target's own)
    # Verifies by drafts carried, and by drafts accepted (0..k_max): `record` is two
    # increments per verify, the per-position counts are read from them.
    drafted_hist: list[int] = field(default_factory=list)
    accepted_hist: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafted_hist = [0] * (self.k_max + 1)
        self.accepted_hist = [0] * (self.k_max + 1)

    def record(self, k: int, res: VerifyResult) -> None:
        self.verify_steps += 1
        self.emitted += len(res.tokens)
        self.drafted_hist[k] += 1
        self.accepted_hist[res.num_accepted] += 1

    @property
    def drafted_per_pos(self) -> list[int]:
        """Drafts verified at each position 0..k_max-1 (a verify of k drafts: positions < k)."""
        return _at_least(self.drafted_hist)

    @property
    def accepted_per_pos(self) -> list[int]:
        """Drafts accepted at each position (a verify accepting n: positions < n)."""
        return _at_least(self.accepted_hist)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verifying target forward (accepted + bonus)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0


def _at_least(hist: list[int]) -> list[int]:
    """[sum(hist[i + 1:]) for i in range(len(hist) - 1)]: of counts by value 0..n, how many
    exceed each position 0..n-1."""
    out, total = [0] * (len(hist) - 1), 0
    for i in range(len(hist) - 1, 0, -1):
        total += hist[i]
        out[i - 1] = total
    return out
