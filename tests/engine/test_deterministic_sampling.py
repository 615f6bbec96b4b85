"""Seeded sampling in the deterministic mode: the token at each index is a pure function of (seed,
index, logits), drawn by Gumbel-max. Its law is the processed distribution (measured, with a
negative control), and a request's tokens are the same alone or in a batch, with speculation
none / n-gram / EAGLE-3 at any K, prefilled on one engine and decoded on another, after a
restart or a resume. Default mode's rejection sampling is shown to differ, so these can fail."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from engine import Engine, SamplingParams
from engine.sampler import gumbel_noise, gumbel_tokens, mix32, processed_logits, processed_probs
from engine.spec.verify import verify_seeded
from engine.testing import random_head, tiny_engine
from tests.engine.test_deterministic_engine import engine_like
from tests.engine.test_handoff import disaggregated
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.spec.test_verify import assert_matches, chi2_pvalue, tv

SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234, max_tokens=24)
# Two likely tokens a step: the tiny model's output repeats, so n-gram drafts get accepted.
NARROW = SamplingParams(temperature=1.0, top_k=2, seed=1234, max_tokens=24)




def test_mix32_equals_the_modular_reference_on_ints_and_tensors():
    def ref(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    rng = random.Random(0)
    xs = [0, 1, 0xFFFFFFFF] + [rng.getrandbits(32) for _ in range(2000)]
    want = [ref(x) for x in xs]
    assert [mix32(x) for x in xs] == want
    assert mix32(torch.tensor(xs, dtype=torch.int64)).tolist() == want


# ---- the law of one draw -------------------------------------------------------------------

LOGITS = torch.tensor([[1.0, 2.2, 0.3, 1.9, -0.5, 0.8]])


def draws(rule, params: SamplingParams, seeds: int = 40, per_seed: int = 500) -> torch.Tensor:
    """Counts of `rule(logits rows, params, seed, first)` over `seeds` seeds, each drawing at
    `per_seed` consecutive indices (fixed seeds and indices: the test is deterministic)."""
    rows = LOGITS.expand(per_seed, -1)
    toks = torch.cat([rule(rows, params, s, 1000 * s) for s in range(seeds)])
    return torch.bincount(toks, minlength=LOGITS.shape[1])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=0.9, top_p=0.7),
])
def test_gumbel_max_samples_the_processed_distribution(params):
    assert_matches(draws(gumbel_tokens, params), processed_probs(LOGITS, params)[0])


def test_harness_rejects_noise_on_probabilities_instead_of_log_probabilities():
    """Negative control: Gumbel noise added to p instead of log p is a wrong law."""
    def wrong(logits, params, seed, first):
        p = processed_probs(logits, params).double()
        return (p + gumbel_noise(seed, first, *p.shape)).argmax(-1)

    params = SamplingParams(temperature=1.0)
    counts, expected = draws(wrong, params), processed_probs(LOGITS, params)[0]
    assert tv(counts, expected) > 0.05 and chi2_pvalue(counts, expected) < 1e-6


def test_draw_is_a_pure_function_of_seed_index_and_logits():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 3
    p = replace(SAMPLED, top_k=0)
    batch = gumbel_tokens(logits, p, 99, 50)
    alone = torch.cat([gumbel_tokens(logits[i : i + 1], p, 99, 50 + i) for i in range(8)])
    assert torch.equal(batch, alone)  # a row's token does not depend on the rows beside it
    assert torch.equal(gumbel_tokens(logits, p, 99, 50), batch)
    assert not torch.equal(gumbel_tokens(logits, p, 98, 50), batch)
    # Excluded tokens are never drawn.
    kept = processed_logits(logits, p).isfinite()
    assert kept.gather(1, batch[:, None]).all()


def test_seeded_verify_emits_exactly_the_plain_draws():
    """Accept a draft iff it is the target's draw at its index; at the first miss emit the
    target's draw: the emitted tokens are the no-speculation tokens."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0)
    want = gumbel_tokens(logits, p, 7, 20).tolist()
    for n in range(6):
        draft = want[:n] + [(want[n] + 1) % 50] * (5 - n) if n < 5 else want[:5]
        res = verify_seeded(draft, logits, p, 7, 20)
        assert res.num_accepted == n and res.tokens == want[: n + 1]


# ---- through the engine --------------------------------------------------------------------

@pytest.fixture(scope="module")
def base() -> Engine:
    return tiny_engine(0, max_num_batched_tokens=64, deterministic=True)


@pytest.fixture(scope="module")
def head(base):
    return random_head(base)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    # Repeated patterns, so n-gram drafts are often right and the accept path runs too.
    rng = random.Random(seed)
    return [[rng.randrange(20) for _ in range(rng.randrange(3, 20))] * 2 for _ in range(n)]


def run(eng: Engine, ps, params=SAMPLED) -> list[list[int]]:
    out = [c.token_ids for c in eng.generate(ps, params)]
    eng.blocks.check_all_free()
    return out


def test_same_seed_same_tokens_alone_and_in_a_batch(base):
    ps = prompts(4)
    alone = run(base, ps[:1])[0]
    crowd = run(base, ps, [SAMPLED, SamplingParams(temperature=1.0, seed=5, max_tokens=30),
                           SamplingParams(temperature=0, max_tokens=10),
                           SamplingParams(temperature=1.2, max_tokens=24)])
    assert crowd[0] == alone
    assert run(base, ps[:1], replace(SAMPLED, seed=4321))[0] != alone


SPECS = [dict(method="ngram", num_tokens=k, dynamic=False) for k in (1, 3, 7)] + \
        [dict(method="ngram", num_tokens=5, dynamic=True)] + \
        [dict(method="eagle3", num_tokens=k, dynamic=False) for k in (1, 4, 7)] + \
        [dict(method="eagle3", num_tokens=5, dynamic=True)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s['method']}-k{s['num_tokens']}"
                         f"{'-dyn' if s['dynamic'] else ''}")
def test_speculation_gives_the_no_speculation_tokens(base, head, spec):
    ps = prompts(3)
    eng = engine_like(base, head, spec)
    for params in (SAMPLED, NARROW):
        want = run(base, ps, params)
        assert run(eng, ps[:1], params) == want[:1]  # alone: each verify row as it runs alone
        assert run(eng, ps, params) == want
    st = eng.spec.stats
    assert st.verify_steps > 0
    if spec["method"] == "ngram":  # the accept path ran too
        assert sum(st.accepted_per_pos) > 0


def test_sampled_drafts_share_the_targets_noise(base):
    """At a temperature so high that every token is almost equally likely, the draw at an index
    is the argmax of its noise alone: drafts that use the noise of the index they draft are
    then nearly always accepted (the head drafts over the whole vocabulary here)."""
    eng = engine_like(base, random_head(base, draft_vocab=base.config.model.vocab_size),
                      dict(method="eagle3", num_tokens=4, dynamic=False))
    hot = SamplingParams(temperature=1e5, seed=3, max_tokens=24)
    ps = prompts(2)
    assert run(eng, ps, hot) == run(base, ps, hot)
    st = eng.spec.stats
    assert sum(st.accepted_per_pos) >= 0.9 * sum(st.drafted_per_pos) > 0


@pytest.mark.parametrize("spec,handoff_drafts", [
    ({}, True), (dict(method="ngram", num_tokens=3, dynamic=False), True),
    (dict(method="eagle3", num_tokens=3, dynamic=False), True),
    (dict(method="eagle3", num_tokens=5, dynamic=True), False),
])
def test_disaggregated_gives_the_colocated_tokens(base, head, spec, handoff_drafts):
    ps = prompts(4, seed=5)
    want = run(base, ps)

    pre, dec = (engine_like(base, head, spec, handoff_drafts=handoff_drafts) for _ in range(2))
    assert disaggregated(pre, dec, ps, SAMPLED) == want


def test_restart_resume_and_preemption_give_the_same_tokens(base):
    ps = prompts(3, seed=7)
    want = run(base, ps)
    assert run(tiny_engine(0, max_num_batched_tokens=64, deterministic=True), ps) == want
    # A stream moved to another engine mid-way (resume): its key is the token's index in the
    # sequence, so it continues exactly where it stopped.
    m = 9
    assert want[0][:m] + _continued(base, ps[0], want[0][:m]) == want[0]
    # Few KV blocks: requests are preempted and recomputed.
    small = base.with_config(num_blocks=24)
    assert run(small, ps) == want
    assert small.scheduler.num_preemptions > 0


def _continued(base: Engine, prompt: list[int], done: list[int]) -> list[int]:
    """Tokens a fresh engine generates for a request resumed after `done` output tokens."""
    eng = base.with_config()
    rid = eng.add_request(prompt + done, SAMPLED, resume=(len(done), 0))
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() if o.request_id == rid for t in o.token_ids]
    return out


def test_default_mode_sampling_differs_with_speculation(base, head):
    """Negative control: rejection sampling is lossless only in law, so for the same seed
    speculation changes the tokens on some prompt; the tests above would catch that."""
    plain = base.with_config(deterministic=False)
    ps = prompts(4)
    want = run(plain, ps, NARROW)
    ngram = dict(method="ngram", num_tokens=3, dynamic=False)
    eng = engine_like(base, head, ngram, deterministic=False)
    got = run(eng, ps, NARROW)
    assert eng.spec.stats.verify_steps > 0 and got != want
    # The same engines in the deterministic mode agree.
    assert run(engine_like(base, head, ngram), ps, NARROW) == run(base, ps, NARROW)
