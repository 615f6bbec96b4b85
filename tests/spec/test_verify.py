"""Verification rules: greedy exactness, and the sampled rule's losslessness, measured.

Each statistical test draws drafts from a known q, runs the verifier many times with fixed
seeds (so the test is deterministic) and checks the emitted tokens against the target law p by
total-variation distance AND a chi-square goodness-of-fit test. Negative controls push known-
wrong rules through the same harness and require it to reject them, so the harness has power.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable

import pytest
import torch

from engine.sampler import new_generator, processed_probs, sample_from
from engine.sequence import SamplingParams
from engine.spec.verify import VerifyResult, verify_greedy, verify_sampled
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

ALPHA = 1e-3  # chi-square significance: a correct rule fails with p-value < ALPHA
TV_BOUND = 0.015  # for 5-6 categories at N = 20000 the expected TV is ~0.005

# Target p and a deliberately different draft q (TV(p, q) = 0.5, sum(min(p, q)) = 0.5).
P = [0.10, 0.35, 0.05, 0.30, 0.20]
Q = [0.40, 0.05, 0.25, 0.10, 0.20]
N = 20000




def tv(counts: torch.Tensor, expected: torch.Tensor) -> float:
    freq = counts.double() / counts.sum()
    return 0.5 * float((freq - expected.double()).abs().sum())


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson goodness of fit; cells with expected 0 must be empty (else p-value 0)."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    zero = expected == 0
    if counts[zero].sum() > 0:
        return 0.0
    e = expected[~zero] * counts.sum()
    stat = ((counts[~zero] - e) ** 2 / e).sum()
    df = torch.tensor((~zero).sum().item() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))  # chi2 survival function


def assert_matches(counts: torch.Tensor, expected: torch.Tensor, bound: float = TV_BOUND):
    assert tv(counts, expected) < bound, (tv(counts, expected), counts.tolist())
    assert chi2_pvalue(counts, expected) > ALPHA, counts.tolist()


def assert_differs(counts: torch.Tensor, expected: torch.Tensor, bound: float = TV_BOUND):
    assert tv(counts, expected) > bound, tv(counts, expected)
    assert chi2_pvalue(counts, expected) < ALPHA


def logits_of(p: list[float]) -> torch.Tensor:
    """Raw logits whose temperature-1 softmax is p (log 0 = -inf)."""
    return torch.tensor(p, dtype=torch.float64).log().float()


Rule = Callable[[list[int], torch.Tensor | None, torch.Tensor, SamplingParams, torch.Generator],
                VerifyResult]


def first_tokens(rule: Rule, logits: torch.Tensor, q_draw: list[float],
                 q_pass: torch.Tensor | None, params: SamplingParams,
                 n: int = N) -> tuple[torch.Tensor, float]:
    """K=1: draft x ~ q_draw, verify with q_pass; counts of the first emitted token and the
    acceptance rate."""
    vocab = logits.shape[-1]
    drafts = torch.multinomial(torch.tensor(q_draw, dtype=torch.float), n, replacement=True,
                               generator=new_generator(1)).tolist()
    target = logits.expand(2, vocab)  # the bonus row is never the first token for K=1
    q = None if q_pass is None else q_pass.reshape(1, vocab)
    g = new_generator(2)
    counts = [0] * vocab
    accepted = 0
    for x in drafts:
        res = rule([x], q, target, params, g)
        counts[res.tokens[0]] += 1
        accepted += res.num_accepted
    return torch.tensor(counts), accepted / n


# -- known-wrong rules for the negative controls ------------------------------------------

def always_accept(draft, q, target_logits, params, generator) -> VerifyResult:
    """Accept every draft: the output follows q, not p."""
    p = processed_probs(target_logits, params)
    return VerifyResult([*draft, int(sample_from(p[-1:], generator)[0])], len(draft))


def resample_from_p(draft, q, target_logits, params, generator) -> VerifyResult:
    """The classic bug: on rejection draw from p instead of normalize(max(0, p - q))."""
    p = processed_probs(target_logits, params)
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else float(q[i, x])
        if float(torch.rand(1, generator=generator)) * q_x >= float(p[i, x]):
            return VerifyResult([*draft[:i], int(sample_from(p[i : i + 1], generator)[0])], i)
    return VerifyResult([*draft, int(sample_from(p[-1:], generator)[0])], len(draft))


# -- greedy -------------------------------------------------------------------------------

def test_greedy_all_accepted_plus_bonus():
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == VerifyResult([4, 5, 6, 7], 3)


def test_greedy_first_mismatch():
    assert verify_greedy([4, 5, 6], [4, 9, 6, 7]) == VerifyResult([4, 9], 1)


def test_greedy_mismatch_at_zero():
    assert verify_greedy([4, 5, 6], [8, 5, 6, 7]) == VerifyResult([8], 0)


def test_greedy_no_drafts_and_bad_length():
    assert verify_greedy([], [3]) == VerifyResult([3], 0)
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_sampled_temperature_zero_is_greedy():
    logits = torch.randn(4, 10, generator=new_generator(0))
    top = logits.argmax(-1).tolist()
    draft = [top[0], top[1], (top[2] + 1) % 10]
    res = verify_sampled(draft, None, logits, SamplingParams(temperature=0), new_generator(0))
    assert res == verify_greedy(draft, top) == VerifyResult(top[:3], 2)


# -- sampled: K = 1 -----------------------------------------------------------------------

def test_sampled_matches_target():
    counts, rate = first_tokens(verify_sampled, logits_of(P), Q, torch.tensor(Q), SamplingParams())
    assert_matches(counts, torch.tensor(P))
    assert abs(rate - 0.5) < 0.015  # acceptance = sum(min(p, q)) = 0.5


def test_negative_control_always_accept():
    counts, _ = first_tokens(always_accept, logits_of(P), Q, torch.tensor(Q), SamplingParams())
    assert_differs(counts, torch.tensor(P))


def test_negative_control_resample_from_p():
    # Emits min(p, q) + 0.5 p: TV 0.175 from p.
    counts, _ = first_tokens(resample_from_p, logits_of(P), Q, torch.tensor(Q), SamplingParams())
    assert_differs(counts, torch.tensor(P))


def test_point_mass_q_none_is_lossless():
    # With q=None each draft is judged as a given token, so the output is p however the
    # drafts were chosen (here: from Q); acceptance is sum(q * p) = 0.14.
    counts, rate = first_tokens(verify_sampled, logits_of(P), Q, None, SamplingParams())
    assert_matches(counts, torch.tensor(P))
    assert abs(rate - 0.14) < 0.012


def test_negative_control_q_lies():
    # Drafts picked deterministically (always token 2) but a softmax q passed: not lossless.
    # That is why argmax drafters must pass q=None.
    counts, _ = first_tokens(verify_sampled, logits_of(P), [0, 0, 1, 0, 0], torch.tensor(Q),
                             SamplingParams())
    assert_differs(counts, torch.tensor(P))


def _processed_by_hand(logits: list[float], temperature: float, top_k: int, top_p: float):
    """Target law after temperature, top-k, top-p, computed independently of the engine."""
    z = [v / temperature for v in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = set(order[:top_k] if top_k else order)
    w = [math.exp(z[i]) if i in keep else 0.0 for i in range(len(z))]
    w = [v / sum(w) for v in w]
    mass, kept = 0.0, set()
    for i in order:
        if w[i] > 0 and mass < top_p:
            kept.add(i)
        mass += w[i]
    w = [w[i] if i in kept else 0.0 for i in range(len(z))]
    return torch.tensor([v / sum(w) for v in w])


def test_sampled_after_temperature_topk_topp():
    # Temperature 0.7, then top-k keeps 4 of 6, then top-p 0.8 drops one more: each filter is
    # active, and drafts often land on the 3 pruned tokens, which must never be emitted.
    raw = [1.0, 2.2, -0.5, 1.7, 0.3, 2.0]
    assert (_processed_by_hand(raw, 0.7, 4, 1.0) > 0).sum() == 4
    expected = _processed_by_hand(raw, 0.7, 4, 0.8)
    assert (expected > 0).sum() == 3
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8)
    q = [0.3, 0.1, 0.2, 0.1, 0.2, 0.1]
    counts, _ = first_tokens(verify_sampled, torch.tensor(raw), q, torch.tensor(q), params)
    assert counts[expected == 0].sum() == 0
    assert_matches(counts, expected)


def test_residual_degenerate_falls_back_to_p():
    # q = 2p is never below p, so max(0, p - q) = 0 everywhere while half the drafts are
    # rejected; the fallback must draw from p (token 0 has p = 0: an all-zero row would
    # silently yield token 0).
    p = [0.0, 0.5, 0.3, 0.2]
    q = torch.tensor([p]) * 2
    g = new_generator(3)
    counts, rejected = torch.zeros(4, dtype=torch.long), 0
    for x in [1, 2, 3] * 2000:
        res = verify_sampled([x], q, logits_of(p).expand(2, 4), SamplingParams(), g)
        counts[res.tokens[0]] += 1
        rejected += res.num_accepted == 0
    assert rejected > 2000 and counts[0] == 0


# -- sampled: K = 3 chains ----------------------------------------------------------------

# A Markov target and draft over 4 tokens: row = law of the next token given the previous.
T = [[0.10, 0.40, 0.30, 0.20], [0.30, 0.10, 0.20, 0.40],
     [0.25, 0.25, 0.10, 0.40], [0.40, 0.30, 0.20, 0.10]]
D = [[0.25, 0.25, 0.25, 0.25], [0.20, 0.20, 0.20, 0.40],
     [0.10, 0.40, 0.10, 0.40], [0.60, 0.10, 0.20, 0.10]]


def first_four(rule: Rule, n: int = N) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Speculative generation from context token 0 with K=3 drafts from D and a target whose
    row i is T given the tokens before it, as a real target's would be; repeat steps until four
    tokens are out. Returns counts of (t1, t2), counts of (t3, t4) and a histogram of the first
    step's num_accepted. t4 is the bonus token whenever the first step accepts all 3 drafts."""
    rng = random.Random(4)
    cum = [[sum(r[: i + 1]) for i in range(4)] for r in D]
    log_t = torch.tensor(T).log()
    d = torch.tensor(D)
    g = new_generator(5)
    params = SamplingParams()
    c12 = [[0] * 4 for _ in range(4)]
    c34 = [[0] * 4 for _ in range(4)]
    hist = [0] * 4
    for _ in range(n):
        out = [0]
        while len(out) < 5:
            ctx = [out[-1]]
            for _ in range(3):
                ctx.append(min(bisect.bisect(cum[ctx[-1]], rng.random()), 3))
            res = rule(ctx[1:], d[ctx[:3]], log_t[ctx], params, g)
            hist[res.num_accepted] += len(out) == 1
            out += res.tokens
        c12[out[1]][out[2]] += 1
        c34[out[3]][out[4]] += 1
    return torch.tensor(c12), torch.tensor(c34), hist


def _joints() -> tuple[torch.Tensor, torch.Tensor]:
    """Exact laws of (t1, t2) and (t3, t4) under the target chain from token 0."""
    t = torch.tensor(T, dtype=torch.float64)
    t3 = torch.linalg.matrix_power(t, 3)[0]
    return t[0].unsqueeze(1) * t, t3.unsqueeze(1) * t


# 16 cells: expected TV ~0.01 at N=20000, so the bound is looser than for 5 cells.
JOINT_BOUND = 0.025


def test_chain_joints():
    c12, c34, hist = first_four(verify_sampled)
    assert min(hist) > 500, hist  # every acceptance length, 0..3, is exercised
    j12, j34 = _joints()
    assert_matches(c12, j12, JOINT_BOUND)
    assert_matches(c34, j34, JOINT_BOUND)


def test_chain_negative_control_resample_from_p():
    c12, c34, _ = first_four(resample_from_p)
    j12, j34 = _joints()
    assert_differs(c12, j12, JOINT_BOUND)
    assert_differs(c34, j34, JOINT_BOUND)


# -- reproducibility ----------------------------------------------------------------------

def _run(seed: int) -> list[VerifyResult]:
    data = new_generator(0)
    g = new_generator(seed)
    params = SamplingParams(temperature=0.9, top_k=20, seed=seed)
    out = []
    for _ in range(40):
        q = torch.rand(3, 50, generator=data).softmax(-1)
        draft = torch.multinomial(q, 1, generator=data).flatten().tolist()
        out.append(verify_sampled(draft, q, torch.randn(4, 50, generator=data) * 3, params, g))
    return out


def test_seeded_reproducible():
    assert _run(11) == _run(11)
    assert _run(11) != _run(12)
