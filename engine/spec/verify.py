"""Lossless verification of one sequence's K draft tokens against the target's K+1 positions.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): every emitted token is
distributed exactly as plain sampling from the target would be, whatever the drafter does.
The deterministic mode verifies sampled drafts like greedy ones instead, against the target's
seeded Gumbel-max tokens (`verify_seeded`): the output is then the very sequence plain sampling
gives, token for token. Batching over sequences is the caller's loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampler import gumbel_tokens, processed_probs, sample_from
from engine.sequence import SamplingParams


@dataclass
class VerifyResult:
    """Tokens to append (accepted drafts, then one target token) and how many drafts passed."""

    tokens: list[int]
    num_accepted: int


def verify_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> VerifyResult:
    """Greedy verification: keep drafts while they equal the target's argmax.

    target_argmax: K+1 entries, the target's argmax at each position. At the first mismatch
    the target's token is emitted instead; if all K match, the bonus target_argmax[K] follows.
    Returns 1..K+1 tokens.
    """
    k = len(draft)
    if len(target_argmax) != k + 1:
        raise ValueError(f"need {k + 1} target tokens for {k} drafts, got {len(target_argmax)}")
    n = 0
    while n < k and draft[n] == target_argmax[n]:
        n += 1
    return VerifyResult([*(int(t) for t in draft[:n]), int(target_argmax[n])], n)


def verify_sampled(draft: Sequence[int], q: torch.Tensor | None, target_logits: torch.Tensor,
                   params: SamplingParams, generator: torch.Generator) -> VerifyResult:
    """Sampled verification: accept draft i with probability min(1, p_i(x) / q_i(x)).

    draft: K tokens, draft[i] drawn from q[i]. q: [K, vocab], or None for a point mass at each
    draft. target_logits: [K+1, vocab] raw; p = processed_probs(target_logits, params), as plain
    sampling uses. On the first rejection a token is drawn from normalize(max(0, p_i - q_i)) and
    verification stops; if all pass, a bonus is drawn from p_K. All randomness comes from
    `generator` (seeded requests replay exactly) on its device; logits elsewhere are copied
    there. temperature=0 falls through to verify_greedy.
    """
    k = len(draft)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} drafts, got {target_logits.shape[0]}")
    if params.greedy:
        return verify_greedy(draft, target_logits.argmax(dim=-1).tolist())
    x = torch.tensor(list(draft), dtype=torch.int64, device=generator.device)
    n, token = verify_sampled_device(x, q, target_logits, params, generator)
    n = int(n)
    return VerifyResult([*(int(t) for t in draft[:n]), int(token)], n)


def verify_sampled_device(x: torch.Tensor, q: torch.Tensor | None, target_logits: torch.Tensor,
                          params: SamplingParams, generator: torch.Generator
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_sampled` without a host sync: x is the K drafts as a device tensor; returns
    (number accepted, the token drawn after them) as 0-d device tensors. The draws are the
    same as `verify_sampled`'s: K uniforms, then one exponential race."""
    p = processed_probs(target_logits.to(generator.device), params)
    k = x.shape[0]
    if k:
        x = x.to(p.device).unsqueeze(1)
        # Accept iff u < p(x)/q(x), written as u*q(x) < p(x): no division, so q(x) = 0 cannot
        # give NaN and p(x) = 0 never passes. A point mass has q(x) = 1.
        lhs = torch.rand(k, 1, generator=generator, device=p.device)
        qx = None if q is None else q[:k].to(p).gather(1, x)
        if qx is not None:
            lhs = lhs * qx
        passed = (lhs < p[:k].gather(1, x)).flatten().to(torch.int64)
        n = passed.cumprod(0).sum()
        # Row i of q_ext: the draft law at position i; row K (the bonus) subtracts nothing.
        q_ext = torch.zeros_like(p)
        if q is None:
            q_ext[:k].scatter_(1, x, 1.0)
        else:
            q_ext[:k] = q[:k].to(p)
        p_n = p.index_select(0, n.view(1))[0]
        residual = (p_n - q_ext.index_select(0, n.view(1))[0]).clamp_(min=0)
        total = residual.sum()
        # p <= q everywhere (only reachable through rounding, or a q that is not normalized):
        # nothing is left to correct, so p itself is the right law. The bonus is p_K as is.
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)
        residual = torch.where(n == k, p_n, residual)
    else:
        n = torch.zeros((), dtype=torch.int64, device=p.device)
        residual = p[0]
    token = sample_from(residual.unsqueeze(0), generator)[0]
    return n, token


def verify_seeded(draft: Sequence[int], target_logits: torch.Tensor, params: SamplingParams,
                  seed: int, first: int) -> VerifyResult:
    """The deterministic mode's verification: keep drafts while they equal the target's own
    draw at their index (`gumbel_tokens` from index `first` on), then emit the target's draw.
    Lossless token for token: the result is what plain seeded sampling emits there."""
    x = torch.tensor(list(draft), dtype=torch.int64, device=target_logits.device)
    n, token = verify_seeded_device(x, target_logits, params, seed, first)
    n = int(n)
    return VerifyResult([*(int(t) for t in draft[:n]), int(token)], n)


def verify_seeded_device(x: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams,
                         seed: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_seeded` without a host sync: x is the K drafts as a device tensor, target_logits
    [K+1, vocab] raw, `first` the index in the sequence of the token row 0 draws. Returns
    (number accepted, the token after them) as 0-d device tensors. temperature=0 is greedy."""
    k = x.shape[0]
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} drafts, got {target_logits.shape[0]}")
    if params.greedy:
        tgt = target_logits.argmax(dim=-1)
    else:
        tgt = gumbel_tokens(target_logits, params, seed, first)
    n = (x.to(tgt.device) == tgt[:k]).to(torch.int64).cumprod(0).sum()
    return n, tgt.index_select(0, n.view(1))[0]
