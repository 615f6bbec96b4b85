"""What the engine tells the dynamic-K policy after each step: how many drafts each request's
verify accepted, and what a pure decode step cost for its batch size and draft length."""

from __future__ import annotations

from engine.scheduler import Batch
from engine.sequence import Sequence
from engine.spec.runtime import SpecRunner


def record_verifies(spec: SpecRunner, seqs: list[Sequence], results: dict) -> None:
    """Count each verify of a step's `results` (entry → (drafts sent, VerifyResult)) that
    carried drafts: for its request (seqs[entry]), the runner's statistics and the policy.
    One pass with the counters bound once, since it runs for every sequence of every step."""
    record, update = spec.stats.record, spec.policy.update
    for i, (k, res) in results.items():
        if k:
            seq, n = seqs[i], res.num_accepted
            seq.num_drafted += k
            seq.num_accepted += n
            seq.num_verify_steps += 1
            record(k, res)
            update(seq, k, n)


def time_step(spec: SpecRunner, batch: Batch, results: dict, seconds: float, how: str = ""
              ) -> None:
    """Feed a step's time to the cost model: pure decode steps (every entry verifies its
    pending token and drafts) as drafts per sequence against time, any other as untimed."""
    costs, b = spec.policy.costs, len(batch.seqs)
    sums = _decode_sums(batch, results) if b and len(results) == b else None
    if sums is None:
        costs.untimed(b, seconds, how)
        return
    ks, kns, k, kn, tokens, greedy = sums
    # A step verifies last step's drafts and proposes the next, so in a steady state their mean
    # is the K of the policy's 1 + f + K*c step cost. A fused step is priced at the graphs'
    # padded sizes (`KPolicy.paid`); a step that switches K is no point of the cost fit.
    switch = False
    if spec.fused is not None and greedy:
        pol = spec.policy
        per_seq = pol.paid(k, kn, b)
        switch = pol.paid(k, batch_size=b) != pol.paid(kn, batch_size=b)
    else:
        per_seq = (ks + kns) / (2 * b)
    costs.record(b, per_seq, seconds, tokens, how, switch)


def _decode_sums(batch: Batch, results: dict) -> tuple | None:
    """(drafts verified, drafts proposed, the most verified, the most proposed, tokens
    emitted, all greedy) over the step's entries in one pass (it runs every step); None where
    an entry did not verify its pending token and drafts."""
    ks = kns = kmax = knmax = tokens = 0
    greedy = True
    for n, (k, res), s in zip(batch.num_tokens, results.values(), batch.seqs):
        if n != k + 1:
            return None
        kn = len(s.draft)
        ks, kns, tokens = ks + k, kns + kn, tokens + len(res.tokens)
        if k > kmax:
            kmax = k
        if kn > knmax:
            knmax = kn
        greedy = greedy and s.params.greedy
    return ks, kns, kmax, knmax, tokens, greedy
