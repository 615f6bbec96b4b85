"""How many tokens a sequence drafts: the K policy's choice, capped by what the sequence may
still emit and by the KV blocks free for its pending token and drafts."""

from __future__ import annotations

from engine.sequence import Sequence
from engine.spec.policy import KPolicy


class DraftBudget:
    """Chooses K per sequence and grows its KV blocks to hold the pending token and drafts."""

    def __init__(self, policy: KPolicy, max_model_len: int):
        self.policy, self.max_model_len = policy, max_model_len

    def k_for(self, seq: Sequence, need: int, blocks, batch_size: int,
              want: int | None = None) -> int | None:
        """K for `seq` whose pending token will be its token number `need` (`want`, or the
        policy's choice): capped by what it may still emit after that token and by free KV
        blocks. Grows the blocks for the pending token and the drafts; None if not even the
        pending token fits."""
        if not blocks.can_grow(seq, need):
            return None
        blocks.grow(seq, need)
        k = self.cap(seq, need, self.policy.choose(seq, batch_size) if want is None else want)
        while k and not blocks.can_grow(seq, need + k):
            k -= 1
        if k:
            blocks.grow(seq, need + k)
        return k

    def cap(self, seq: Sequence, need: int, k: int) -> int:
        """k drafts capped by what `seq` may still emit after its pending token (token number
        `need`): each verify of k drafts emits k + 1 tokens, within its length limit; and by
        the request's own draft limit."""
        left = seq.length_limit(self.max_model_len) - need - 1
        k = min(k, left) if left > 0 else 0
        return k if seq.max_draft is None else min(k, seq.max_draft)

    def ks_for(self, seqs, needs: list[int], blocks, want: int | None) -> list[int | None]:
        """`k_for` over a batch (seqs[i]'s pending token will be token number needs[i]): None for a
        sequence whose pending token does not fit. Given one K (`want`, the fused batch policy's),
        the blocks are checked once for the whole batch when they all fit, to shrink the host's
        step; otherwise sequence by sequence."""
        if want is not None:
            ks = [self.cap(s, n, want) for s, n in zip(seqs, needs)] if want else \
                [0] * len(seqs)
            if blocks.grow_all(seqs, [n + k for n, k in zip(needs, ks)]):
                return ks
        return [self.k_for(s, n, blocks, len(seqs), want) for s, n in zip(seqs, needs)]
