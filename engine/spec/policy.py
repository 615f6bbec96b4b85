"""Dynamic K: how many tokens to draft for a sequence, from its measured acceptance and the
batch size, down to 0 (plain decode) when speculation stops paying."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.sequence import Sequence

PROBE_EVERY = 8  # a sequence at K=0 drafts one token this often, to notice recovery


class KPolicy:
    """Maximizes expected tokens per unit of step cost.

    With per-token acceptance a, K drafts emit (1 - a^(K+1)) / (1 - a) tokens per target
    forward; the step costs 1 + K * (verify + draft) relative to a plain decode step. Verify
    cost per token grows with the batch (the forward leaves the memory-bound regime).
    """

    def __init__(self, spec: SpecConfig, prior: float = 0.6, batch_knee: int = 16):
        self.spec, self.prior, self.knee = spec, prior, batch_knee

    def choose(self, seq: Sequence, batch_size: int) -> int:
        kmax = self.spec.num_tokens
        if not self.spec.dynamic or kmax == 0:
            return kmax
        a = min(seq.accept_rate if seq.accept_rate is not None else self.prior, 0.999)
        per_token = self.spec.verify_token_cost * max(1.0, batch_size / self.knee)
        per_token += self.spec.draft_step_cost
        best_k, best = 0, 1.0
        for k in range(1, kmax + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (1 + k * per_token)
            if gain > best * 1.02:  # a margin: don't speculate for a rounding-error win
                best_k, best = k, gain
        if best_k == 0:
            seq.idle_steps += 1
            if seq.idle_steps % PROBE_EVERY == 0:
                return 1
        return best_k

    @staticmethod
    def update(seq: Sequence, drafted: int, accepted: int) -> None:
        """Fold one verify result into the sequence's acceptance estimate."""
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        rate = accepted / trials
        seq.accept_rate = rate if seq.accept_rate is None else 0.7 * seq.accept_rate + 0.3 * rate
