"""What the engine tells the dynamic-K policy after each step: how many drafts each request's
verify accepted, and what a pure decode step cost for its batch size and draft length."""

from __future__ import annotations

from engine.scheduler import Batch
from engine.sequence import Sequence
from engine.spec.runtime import SpecRunner
from engine.spec.verify import VerifyResult


def record_verify(spec: SpecRunner, seq: Sequence, k: int, res: VerifyResult) -> None:
    """Count a verify of `k` drafts for the request, the runner's statistics and the policy."""
    seq.num_drafted += k
    seq.num_accepted += res.num_accepted
    seq.num_verify_steps += 1
    spec.stats.record(k, res)
    spec.policy.update(seq, k, res.num_accepted)


def time_step(spec: SpecRunner, batch: Batch, results: dict, seconds: float, how: str = ""
              ) -> None:
    """Feed a step's time to the cost model: pure decode steps (every entry verifies its
    pending token and drafts) as drafts per sequence against time, any other as untimed."""
    costs = spec.policy.costs
    if len(results) != len(batch.seqs) or \
            any(n != k + 1 for n, (k, _) in zip(batch.num_tokens, results.values())):
        costs.untimed(len(batch.seqs), seconds, how)
        return
    # A step verifies last step's drafts and proposes the next, so in a steady state their mean
    # is the K of the policy's 1 + f + K*c step cost. A fused step is priced at the graphs'
    # padded sizes (`KPolicy.paid`); a step that switches K is no point of the cost fit.
    b, switch = len(batch.seqs), False
    if spec.fused is not None and all(s.params.greedy for s in batch.seqs):
        pol = spec.policy
        k, kn = max(k for k, _ in results.values()), max(len(s.draft) for s in batch.seqs)
        per_seq = pol.paid(k, kn, b)
        switch = pol.paid(k, batch_size=b) != pol.paid(kn, batch_size=b)
    else:
        drafts = sum(k for k, _ in results.values()) + sum(len(s.draft) for s in batch.seqs)
        per_seq = drafts / (2 * b)
    tokens = sum(len(r.tokens) for _, r in results.values())
    costs.record(b, per_seq, seconds, tokens, how, switch)
