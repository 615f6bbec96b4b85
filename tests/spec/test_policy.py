"""Dynamic K: speculate deeper when drafts land, back off to plain decoding when they don't."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from engine.config import SpecConfig
from engine.sequence import SamplingParams, Sequence
from engine.spec.policy import (
    BATCH_PROBE_EVERY,
    BATCH_START_MARGIN,
    PROBE_EVERY,
    PROBE_LEN,
    KPolicy,
)


def seq_with_rate(rate):
    s = Sequence([1, 2, 3], SamplingParams())
    s.accept_rate = rate
    return s


def test_k_grows_with_acceptance():
    pol = KPolicy(SpecConfig(num_tokens=7))
    ks = [pol.choose(seq_with_rate(a), batch_size=1) for a in (0.3, 0.5, 0.7, 0.9)]
    assert ks == sorted(ks) and ks[-1] == 7 and ks[0] < ks[-1]


def test_low_acceptance_falls_back_to_plain_decoding_with_probes():
    pol = KPolicy(SpecConfig(num_tokens=5))
    s = seq_with_rate(0.02)
    ks = [pol.choose(s, batch_size=1) for _ in range(2 * PROBE_EVERY)]
    assert ks.count(0) == 2 * PROBE_EVERY - 2 and ks.count(1) == 2  # periodic one-token probes


def test_large_batches_draft_less():
    pol = KPolicy(SpecConfig(num_tokens=7))
    s = seq_with_rate(0.7)
    assert pol.choose(s, batch_size=256) < pol.choose(s, batch_size=1)


def test_fixed_k_when_not_dynamic():
    pol = KPolicy(SpecConfig(num_tokens=4, dynamic=False))
    assert pol.choose(seq_with_rate(0.0), batch_size=64) == 4


def test_update_tracks_acceptance():
    pol = KPolicy(SpecConfig(num_tokens=4))
    s = seq_with_rate(None)
    for _ in range(20):
        pol.update(s, drafted=4, accepted=4)
    high = s.accept_rate
    for _ in range(20):
        pol.update(s, drafted=4, accepted=0)
    assert high > 0.95 and s.accept_rate < 0.05
    assert s.accept_runs is None  # the geometric model keeps no per-depth counts


def test_runs_model_drafts_deeper_where_acceptance_comes_in_runs():
    """accept_model "runs": a sequence whose drafts are accepted all or nothing (an answer
    that loops: depth 1 lands half the time, every later depth whenever the one before did)
    has per-depth counts that show every draft past the first landing, so K goes to the
    maximum. A sequence whose acceptance really is independent gets about the geometric
    model's K."""
    import random

    geo = KPolicy(SpecConfig(num_tokens=7))
    runs = KPolicy(SpecConfig(num_tokens=7, accept_model="runs"))
    a, b = seq_with_rate(None), seq_with_rate(None)
    for i in range(40):
        geo.update(a, drafted=7, accepted=7 if i % 2 else 0)
        runs.update(b, drafted=7, accepted=7 if i % 2 else 0)
    assert b.accept_runs is not None and a.accept_runs is None
    # (The geometric rate is accepted over tried drafts: 7 of every 8 here.)
    assert runs.choose(b, batch_size=1) == 7 and a.accept_rate > 0.85
    rng = random.Random(0)
    c, d = seq_with_rate(None), seq_with_rate(None)
    for _ in range(200):
        acc = next((j for j in range(5) if rng.random() > 0.6), 5)  # independent, a = 0.6
        geo.update(c, drafted=5, accepted=acc)
        runs.update(d, drafted=5, accepted=acc)
    assert abs(geo.choose(c, batch_size=1) - runs.choose(d, batch_size=1)) <= 2


def test_runs_model_in_the_engine_is_lossless():
    """Dynamic K with accept_model "runs" through the engine (fused batch K, per-sequence K,
    probes): greedy output equals plain decoding, and the sequences kept per-depth counts."""
    from dataclasses import replace

    from engine import Engine
    from tests.helpers import tiny_engine
    from tests.spec.test_eagle3 import random_head

    base = tiny_engine(0)
    spec = SpecConfig(num_tokens=4, dynamic=True, accept_model="runs")
    eng = Engine(replace(base.config, spec=spec), weights_of=base, draft_head=random_head(base))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15]]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [c.token_ids for c in base.generate(prompts, sp)]
    seen = []
    update = eng.spec.policy.update

    def record(seq, drafted, accepted):
        update(seq, drafted, accepted)
        seen.append(seq.accept_runs is not None)

    eng.spec.policy.update = record
    assert [c.token_ids for c in eng.generate(prompts, sp)] == want
    assert seen and all(seen)
    eng.blocks.check_all_free()


def test_unknown_acceptance_model_is_refused():
    import pytest

    with pytest.raises(ValueError, match="accept_model"):
        SpecConfig(accept_model="markov")


def test_measured_costs_replace_the_configured_guess():
    """Plain steps of 1 ms and K=4 steps of 2 ms → each draft costs 0.25 of a step: K stays
    modest at a=0.6; at 1 ms per draft (K=1 steps of 2 ms, K=4 of 5 ms) no K pays and
    speculation switches off."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    assert costs.per_token(4) is None
    costs.record(4, 4.0, 2e-3)
    costs.record(4, 4.0, 2e-3)  # no plain time yet: nothing to compare against
    assert costs.per_token(4) is None
    costs.record(3, 0, 1e-3)
    costs.record(3, 0, 1e-3)  # bucket 4
    costs.record(4, 4.0, 2e-3)
    assert abs(costs.per_token(4) - 0.25) < 1e-9 and costs.per_token(16) is None
    pol = KPolicy(SpecConfig(num_tokens=7))
    s = seq_with_rate(0.6)
    guess = pol.choose(s, batch_size=4)
    pol.costs = costs
    measured = pol.choose(s, batch_size=4)
    assert 0 < measured < guess
    for _ in range(StepCosts.LEVEL_WINDOW):
        costs.record(4, 4.0, 5e-3)
        costs.record(4, 1.0, 2e-3)  # one draft doubles the step
    assert abs(costs.per_token(4) - 1.0) < 1e-9 and costs.fixed_cost(4) == 0.0
    assert pol.choose(seq_with_rate(0.6), batch_size=4) == 0


def test_a_fixed_drafting_cost_is_split_from_the_price_of_a_draft():
    """Host-bound drafting (H200, one stream): every drafting step ~1.0 ms whatever its K,
    a plain one 0.55 ms. Priced per draft alone (K=1 steps only) a draft costs ~0.8 of a
    step and no K pays; once a deeper level is timed the line through the levels splits a
    fixed ~0.8 from a small price per draft, and K goes deep."""
    from engine.spec.costs import StepCosts, _fit_line

    costs = StepCosts()
    for _ in range(4):
        costs.record(1, 0, 0.55e-3, tokens=1)
    for _ in range(6):
        costs.record(1, 1.0, 1.0e-3, tokens=2)
    assert abs(costs.per_token(1) - 0.45 / 0.55) < 1e-9 and costs.fixed_cost(1) == 0.0
    pol = KPolicy(SpecConfig(num_tokens=7))
    pol.costs = costs
    pol.begin_propose(PROBE_LEN + 1, batch_size=1)  # neither a plain nor a draft probe
    assert pol.choose_batch([seq_with_rate(0.6)], 1) == 0
    for _ in range(3):
        costs.record(1, 7.0, 1.05e-3, tokens=3)
    fixed, per = costs.fixed_cost(1), costs.per_token(1)
    assert 0.7 < fixed < 0.85 and 0 < per < 0.02
    assert pol.choose_batch([seq_with_rate(0.6)], 1) >= 5
    # the line's edges: a falling line is all fixed cost, one through negative fixed cost
    # goes through the origin instead
    assert _fit_line([(1.0, 0.8, 4), (7.0, 0.6, 4)]) == (0.7, 0.0)
    f, c = _fit_line([(1.0, 0.1, 4), (4.0, 1.0, 4)])
    assert f == 0.0 and abs(c - (0.1 + 4.0) / 17) < 1e-12


def test_a_drafting_level_not_timed_lately_leaves_the_fit():
    """Costs follow the load: a level last timed STALE steps ago (another phase of the
    traffic) no longer bends the line; a bucket whose drafting was not timed for STALE
    steps is priced by the configured guess, and its measured gain is read from fresh
    steps only."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    costs.record(4, 0, 1e-3)
    costs.record(4, 0, 1e-3)
    costs.record(4, 7.0, 8e-3)  # the switch: not timed
    costs.record(4, 7.0, 8e-3)  # 1 per draft at 7
    costs.record(4, 1.0, 1.5e-3)
    assert costs.fixed_cost(4) == 0.0 and costs.per_token(4) > 0.5
    for _ in range(StepCosts.STALE):
        costs.record(4, 1.0, 1.5e-3)
    assert costs.fixed_cost(4) == 0.0 and abs(costs.per_token(4) - 0.5) < 1e-9
    costs.record(4, 0, 1e-3, tokens=4)
    for _ in range(StepCosts.STALE):
        costs.record(4, 0, 1e-3, tokens=4)
    assert costs.per_token(4) is None and costs.fixed_cost(4) == 0.0


def test_measured_gain_is_per_sequence_and_fresh():
    """A bucket spans batch sizes (3 and 4 share bucket 4): plain steps of 4 sequences and
    drafting steps of 3 compare per sequence. A drafting rate read STALE steps ago no
    longer holds the bucket's gain."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    for _ in range(4):
        costs.record(4, 0, 1e-3, tokens=4)  # 1 token a sequence per ms
    for _ in range(4):
        costs.record(3, 4.0, 1.5e-3, tokens=6)  # 2 tokens a sequence per 1.5 ms
    assert abs(costs.measured_gain(4) - 2 / 1.5) < 1e-9
    for _ in range(StepCosts.STALE):
        costs.record(4, 0, 1e-3, tokens=4)
    assert costs.measured_gain(4) is None


def test_one_stalled_step_does_not_skew_the_costs():
    """A plain step that stalls (a graph captured, a kernel compiled) must not make every
    draft look free, nor a stalled spec step make speculation look ruinous."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    for _ in range(5):
        costs.record(16, 0, 1e-3)
    costs.record(16, 0, 60e-3)  # a 60x stall
    assert abs(costs.plain[16] - 1e-3) < 1e-12
    for _ in range(5):
        costs.record(16, 2.0, 1.5e-3)
    costs.record(16, 2.0, 200e-3)
    assert abs(costs.per_token(16) - 0.25) < 1e-9


def test_transitions_between_plain_and_drafting_are_not_timed():
    """The first step of a regime holds the switch's extra work (a relaunch from host-packed
    inputs; with overlap, the next launch too): a plain probe's first step must not pass
    for the price of plain decoding, nor the first drafting step after it for a draft's."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    costs.record(64, 1.0, 2e-3)
    for _ in range(3):
        costs.record(64, 1.0, 2e-3)  # drafting, settled
        costs.record(64, 0, 4e-3)  # a lone plain step: only transitions
    assert not costs.knows_plain(64)
    for t in (4e-3, 1e-3, 1e-3, 1e-3):  # a probe: its first step is the switch
        costs.record(64, 0, t)
    assert costs.plain[64] == 1e-3
    costs.record(64, 1.0, 9e-3)  # back to drafting: the switch, not priced
    assert costs.per_token(64) == 1.0  # the settled drafting steps before: 2 ms per 1 ms
    costs.record(64, 1.0, 1.5e-3)
    costs.record(64, 1.0, 1.5e-3)
    costs.record(64, 1.0, 1.5e-3)
    assert abs(costs.per_token(64) - 0.5) < 1e-9  # median of 2, 2, 1.5, 1.5, 1.5 ms steps
    costs.record(64, 0.1, 5e-3)  # sparse drafts: neither kind, and it breaks the regime
    costs.record(64, 0, 7e-3)
    assert costs.plain[64] == 1e-3


def test_sparse_drafts_are_not_priced_and_draft_probes_use_the_prior():
    """A step where a few sequences probe one draft each says little about a draft's price
    (timing noise over a tiny count); and where measured costs switched drafting off, a
    draft probe still drafts (from the configured costs) so the price keeps being measured."""
    from engine.spec.costs import StepCosts
    from engine.spec.policy import PLAIN_PROBE_EVERY

    costs = StepCosts()
    costs.record(16, 0, 1e-3)
    costs.record(16, 0, 1e-3)
    costs.record(16, 0.1, 1.2e-3)  # 2 probing sequences of 16: would read as 2.0 per draft
    costs.record(16, 0.1, 1.2e-3)
    assert costs.per_token(16) is None
    costs.record(16, 2.0, 10e-3)
    costs.record(16, 2.0, 10e-3)  # every draft costs 4.5 plain steps
    assert abs(costs.per_token(16) - 4.5) < 1e-9
    pol = KPolicy(SpecConfig(num_tokens=5))
    pol.costs = costs
    s = seq_with_rate(0.6)
    pol.begin_propose(3, batch_size=16)
    assert not pol.draft_probe and pol.choose(s, batch_size=16) == 0
    pol.begin_propose(PLAIN_PROBE_EVERY // 2, batch_size=16)
    assert pol.draft_probe and pol.choose(seq_with_rate(0.6), batch_size=16) > 0


def test_plain_probes_time_a_plain_step():
    pol = KPolicy(SpecConfig(num_tokens=5))
    s = seq_with_rate(0.9)
    picks = []
    for step in range(1, 20):
        pol.begin_propose(step, batch_size=2)
        picks.append(pol.choose(s, batch_size=2))
    # Plain time unknown: PROBE_LEN consecutive probe steps every 4 * PROBE_LEN.
    every = 4 * PROBE_LEN
    assert [i + 1 for i, k in enumerate(picks) if k == 0] == \
        [s for s in range(1, 20) if s % every < PROBE_LEN]
    pol.costs.record(2, 0, 1e-3)
    pol.costs.record(2, 0, 1e-3)
    pol.begin_propose(every, batch_size=2)
    assert pol.choose(s, batch_size=2) > 0  # known now: probes only every PLAIN_PROBE_EVERY
    fixed = KPolicy(SpecConfig(num_tokens=5, dynamic=False))
    fixed.begin_propose(8, batch_size=2)
    assert fixed.choose(s, batch_size=2) == 5


def test_engine_times_pure_decode_steps():
    """The engine feeds its step times to the cost model (an injected clock: spec steps look
    expensive), and dynamic K then turns speculation off; output stays lossless."""
    from dataclasses import replace

    from engine import Engine
    from tests.helpers import tiny_engine
    from tests.spec.test_eagle3 import random_head

    base = tiny_engine(0)
    eng = Engine(replace(base.config, spec=SpecConfig(num_tokens=4, dynamic=True)),
                 weights_of=base, draft_head=random_head(base))
    now, verified = [0.0], [0]

    def clock():  # each call advances by 1 ms plus 3 ms per draft proposed or verified since
        done = sum(eng.spec.stats.drafted_per_pos)
        now[0] += 1e-3 + 3e-3 * (sum(len(s.draft) for s in eng.seqs.values())
                                 + done - verified[0])
        verified[0] = done
        return now[0]

    eng.clock = clock
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = [c.token_ids for c in base.generate(prompts, sp)]
    assert [c.token_ids for c in eng.generate(prompts, sp)] == want
    costs = eng.spec.policy.costs
    assert costs.knows_plain(2) and costs.per_token(2) is not None
    assert costs.per_token(2) > 1.0  # a draft costs more than a whole plain step here


def test_batch_k_is_one_k_for_the_whole_fused_step():
    """A fused step's grid is uniform: one K for the batch, maximizing the batch's expected
    tokens per cost; a batch where no K pays stays at 0 and probes together, every
    PROBE_EVERY steps, instead of one sequence at a time."""
    from engine.spec.costs import StepCosts

    pol = KPolicy(SpecConfig(num_tokens=7))
    pol.costs.plain[4], pol.costs.per_draft[4] = 1e-3, 0.25  # measured: a draft = 1/4 step
    mixed = [seq_with_rate(a) for a in (0.9, 0.9, 0.1, 0.1)]
    # Alone, the good drafters would take K=4 and the bad ones 0; the batch pays 4 rows for
    # everyone then, so the best K for the sum is lower.
    assert [pol.choose(s, 4) for s in mixed] == [4, 4, 0, 0]
    assert pol.choose_batch(mixed, 4) == 3
    pol.costs = StepCosts()
    pol.costs.plain[64], pol.costs.per_draft[64] = 1e-3, 1.0  # a draft costs a whole step
    low = [seq_with_rate(0.3) for _ in range(64)]
    ks = [pol.choose_batch(low, 64) for _ in range(2 * BATCH_PROBE_EVERY)]
    assert ks.count(1) == 2 and ks.count(0) == 2 * BATCH_PROBE_EVERY - 2
    assert pol.batch_ks[0] == ks.count(0) and pol.batch_ks[1] == 2
    pol.begin_propose(0, 64)  # a plain probe step
    assert pol.plain_probe and pol.choose_batch([seq_with_rate(0.99)] * 64, 64) == 0
    fixed = KPolicy(SpecConfig(num_tokens=4, dynamic=False))
    assert fixed.choose_batch(low, 64) == 4


def test_dynamic_k_keeps_a_fused_verify_within_the_token_budget():
    """However well drafts land and however cheap a draft measures, dynamic K keeps batch *
    (K + 1) verified tokens within verify_token_budget (384: K <= 5 at 64 streams, 2 at 128,
    none at 384 streams, probes included); 0 lifts the cap, and a fixed K ignores it."""
    good = [seq_with_rate(0.95) for _ in range(64)]
    pol = KPolicy(SpecConfig(num_tokens=7))
    for b in (64, 128):
        pol.costs.plain[b], pol.costs.per_draft[b] = 1e-3, 0.01
    assert pol.choose_batch(good, 64) == 5 and pol.choose(good[0], 64) == 5
    assert pol.choose_batch(good * 2, 128) == 2
    assert pol.choose_batch([seq_with_rate(0.95)] * 8, 8) == 7  # 64 tokens: uncapped
    assert [pol.choose_batch(good * 6, 384) for _ in range(2 * BATCH_PROBE_EVERY)] == [0] * (
        2 * BATCH_PROBE_EVERY)
    s = seq_with_rate(0.95)
    assert [pol.choose(s, 384) for _ in range(2 * PROBE_EVERY)] == [0] * 2 * PROBE_EVERY
    uncapped = KPolicy(SpecConfig(num_tokens=7, verify_token_budget=0))
    uncapped.costs.plain[64], uncapped.costs.per_draft[64] = 1e-3, 0.01
    assert uncapped.choose_batch(good, 64) == 7
    assert KPolicy(SpecConfig(num_tokens=7, dynamic=False)).choose_batch(good, 64) == 7


def test_a_negative_verify_token_budget_is_refused():
    import pytest

    with pytest.raises(ValueError, match="verify_token_budget"):
        SpecConfig(verify_token_budget=-1)


def test_a_batch_leaves_k0_only_for_a_clear_win():
    """A draft at half a plain step's price and acceptance 0.6 predict K=1 at 1.6 / 1.5 =
    1.067x: enough for a lone sequence (2% margin), not for a fused batch, which must
    predict BATCH_START_MARGIN to leave K=0. Clear wins still draft."""
    from engine.spec.policy import BATCH_START_MARGIN

    assert 1.6 / 1.5 < BATCH_START_MARGIN
    pol = KPolicy(SpecConfig(num_tokens=7))
    pol.costs.plain[64], pol.costs.per_draft[64] = 1e-3, 0.5
    batch = [seq_with_rate(0.6) for _ in range(64)]
    assert pol.choose(batch[0], 64) == 1
    assert pol.choose_batch(batch, 64) == 0
    assert pol.choose_batch([seq_with_rate(0.9) for _ in range(64)], 64) >= 2


def test_a_new_arrival_drafts_only_when_its_batch_does():
    """A request admitted beside a batch whose fused steps run at K=0 proposes no drafts at
    its prefill (they would make the whole batch's next step verify K+1 rows); beside a
    drafting batch, or alone, it drafts by its own estimate."""
    pol = KPolicy(SpecConfig(num_tokens=7))
    pol.costs.plain[64], pol.costs.per_draft[64] = 1e-3, 0.5
    batch = [seq_with_rate(0.6) for _ in range(64)]
    arrival = seq_with_rate(0.6)
    assert pol.choose(arrival, 64) == 1  # no fused step yet
    assert pol.choose_batch(batch, 64) == 0
    assert pol.choose(arrival, 64) == 0
    assert pol.choose(arrival, 1) >= 1  # alone: its own K (the configured costs at 1)
    assert pol.choose_batch([seq_with_rate(0.9) for _ in range(64)], 64) >= 2
    assert pol.choose(arrival, 64) == 1


def test_measured_throughput_overrules_a_model_that_predicts_a_win():
    """Drafting priced cheap per draft (0.25 of a step) but emitting fewer tokens per second
    than plain decoding: the batch decodes plainly, except in draft probes; once drafting
    steps measure faster than plain ones, the model's K comes back."""
    from engine.spec.costs import StepCosts
    from engine.spec.policy import PLAIN_PROBE_EVERY

    costs = StepCosts()
    for _ in range(3):
        costs.record(4, 0, 1e-3, tokens=4)  # plain: 4000 tokens/s
    for _ in range(3):
        costs.record(4, 4.0, 2e-3, tokens=6)  # drafting: 3000 tokens/s, 0.25 per draft
    assert abs(costs.per_token(4) - 0.25) < 1e-9
    assert abs(costs.measured_gain(4) - 0.75) < 1e-9 and costs.measured_gain(8) is None
    pol = KPolicy(SpecConfig(num_tokens=7))
    pol.costs = costs
    seqs = [seq_with_rate(0.9) for _ in range(4)]
    assert pol.choose(seqs[0], batch_size=4) == 0
    ks = [pol.choose_batch(seqs, 4) for _ in range(2 * BATCH_PROBE_EVERY)]
    # batch probes only, at a small batch every PROBE_EVERY steps
    assert ks.count(0) == 2 * BATCH_PROBE_EVERY - 2 * BATCH_PROBE_EVERY // PROBE_EVERY
    pol.begin_propose(PLAIN_PROBE_EVERY // 2, batch_size=4)
    assert pol.draft_probe and pol.choose_batch(seqs, 4) > 0
    pol.begin_propose(PROBE_LEN + 1, batch_size=4)  # neither a plain nor a draft probe
    assert not pol.plain_probe and not pol.draft_probe
    for _ in range(StepCosts.WINDOW):
        costs.record(4, 4.0, 2e-3, tokens=12)  # drafting now 6000 tokens/s
    assert costs.measured_gain(4) > 1
    assert pol.choose_batch(seqs, 4) > 0 and pol.choose(seqs[0], batch_size=4) > 0


def test_measured_throughput_counts_the_tokens_steps_deliver_together():
    """Drafting steps emit lumpy token counts: most one token, some four. Together they
    deliver more tokens per second than plain steps even though the median step's rate is
    lower, and that is what decides; a stalled step (a capture, the host descheduled) does
    not count."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    for _ in range(8):
        costs.record(1, 0, 1e-3, tokens=1)  # plain: 1000 tokens/s
    costs.record(1, 0, 50e-3, tokens=1)  # a stall
    for i in range(16):
        costs.record(1, 3.0, 1.2e-3, tokens=4 if i % 5 < 2 else 1)  # 2.2 tokens a step
    rate = (2 * 4 + 3 * 1) / 5 / 1.2e-3
    assert abs(costs.measured_gain(1) - rate / 1000) < 0.05 * rate / 1000
    assert costs.measured_gain(1) > 1.5  # the median step's rate (833 tokens/s) would lose


def test_a_seeded_sampled_request_ignores_measured_throughput():
    """A seeded request's K must not depend on timings (its draws depend on its K)."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    for _ in range(3):
        costs.record(1, 0, 1e-3, tokens=1)
    for _ in range(3):
        costs.record(1, 2.0, 4e-3, tokens=2)
    assert costs.measured_gain(1) < 1
    pol = KPolicy(SpecConfig(num_tokens=5))
    pol.costs = costs
    seeded = Sequence([1, 2, 3], SamplingParams(temperature=0.7, seed=3))
    seeded.accept_rate = 0.9
    assert pol.choose(seeded, batch_size=1) > 0
    assert pol.choose(seq_with_rate(0.9), batch_size=1) == 0


def test_batch_told_to_draft_nothing_grows_blocks_like_the_per_sequence_path():
    """`DraftBudget.ks_for` with want 0 (one check of the total, then the grows) leaves the
    same block tables and K as `k_for` sequence by sequence; where the free blocks run out
    it falls back to that path, which marks the sequences that do not fit (None)."""
    from engine.block_manager import BlockManager
    from engine.spec.budget import DraftBudget

    def budget():
        return DraftBudget(KPolicy(SpecConfig(num_tokens=4, dynamic=True)), 1000)

    def batch(free: int):
        bm = BlockManager(free + 7, 4, enable_prefix_caching=False)
        seqs = []
        for n in (3, 4, 8, 9):  # tokens; each holds the blocks its tokens need
            s = Sequence(list(range(n)), SamplingParams(temperature=0, max_tokens=50))
            bm.grow(s, n)
            seqs.append(s)
        return bm, seqs

    for free in (10, 2, 0):
        fast, slow = batch(free), batch(free)
        needs = [len(s) + 2 for s in fast[1]]  # 5, 6, 10, 11 tokens: 3 more blocks
        got = budget().ks_for(fast[1], needs, fast[0], 0)
        ref = [budget().k_for(s, n, slow[0], 4, 0) for s, n in zip(slow[1], needs)]
        assert got == ref
        assert [s.block_table for s in fast[1]] == [s.block_table for s in slow[1]]
        assert fast[0].num_free == slow[0].num_free
        assert (None in got) == (free < 3)


def test_a_small_batch_at_k0_retries_drafting_sooner_than_a_large_one():
    """A fused batch held at K=0 by low acceptance drafts one token every PROBE_EVERY steps
    at SMALL_BATCH sequences or fewer (where the probe costs little), every
    BATCH_PROBE_EVERY steps above."""
    from engine.spec.policy import SMALL_BATCH

    pol = KPolicy(SpecConfig(num_tokens=7))
    small = [seq_with_rate(0.05) for _ in range(SMALL_BATCH)]
    ks = [pol.choose_batch(small, SMALL_BATCH) for _ in range(BATCH_PROBE_EVERY)]
    assert ks.count(1) == BATCH_PROBE_EVERY // PROBE_EVERY and set(ks) == {0, 1}
    pol = KPolicy(SpecConfig(num_tokens=7))
    large = [seq_with_rate(0.05) for _ in range(SMALL_BATCH + 1)]
    ks = [pol.choose_batch(large, SMALL_BATCH + 1) for _ in range(BATCH_PROBE_EVERY)]
    assert ks.count(1) == 1 and ks[-1] == 1


def test_fused_batches_price_k_by_the_padded_graph_sizes():
    """With graph levels 1, 2, 4, 8 (verify rows) and 0, 1, 2, 4, 7 (chain steps), K=5 runs
    what K=7 runs: priced alike, K=7 emits more, so K=5 is never the batch's pick; the
    step-by-step path (per-sequence choose) keeps the linear price."""
    pol = KPolicy(SpecConfig(num_tokens=7, verify_token_budget=0))
    assert pol.paid(5) == 5 and pol.paid(2, 4) == 3
    pol.levels = ((1, 2, 4, 8), (0, 1, 2, 4, 7))
    assert [pol.paid(k) for k in range(8)] == [0, 1, 2.5, 3.5, 5.5, 7, 7, 7]
    assert pol.paid(7, 0) == 3.5 and pol.paid(0, 1) == 0.5
    picks = set()
    for a in np.linspace(0.3, 0.98, 35):
        for c in (0.02, 0.05, 0.1, 0.2):
            k = pol._best_k([a] * 4, c, kmax=7, padded=True)
            picks.add(k)
            assert k not in (5, 6)
            # the pick maximizes tokens over the padded price
            tok = [(1 - a ** (j + 1)) / (1 - a) for j in range(8)]
            best = max(tok[j] / (1 + c * pol.paid(j)) for j in range(8))
            assert tok[k] / (1 + c * pol.paid(k)) >= best / 1.11
    assert {1, 2, 7} <= picks
    # the verify token budget counts padded rows: 64 sequences verify 4 rows (K <= 3, not
    # K = 5, whose 6 rows run as 8), 48 sequences 8 rows
    budget = KPolicy(SpecConfig(num_tokens=7, verify_token_budget=384))
    budget.levels = pol.levels
    assert budget._kmax(64) == 5 and budget._kmax(64, padded=True) == 3
    assert budget._kmax(48, padded=True) == 7 and budget._kmax(512, padded=True) == 0
    # unpadded, somewhere in the same sweep K=5 or 6 is the pick
    assert any(pol._best_k([a] * 4, c, kmax=7) in (5, 6)
               for a in np.linspace(0.3, 0.98, 35) for c in (0.02, 0.05, 0.1, 0.2))


def test_plain_step_time_is_the_lower_quartile_of_its_window():
    """A plain step's time is read low: the steps after an admission run slow, and a median
    over a window holding several of them would make every draft look cheap."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    times = [1.1e-3] * 8 + [2.0e-3] * 7  # 7 of 15 disturbed: the median is still 1.1 ms...
    times[3:10] = [2.0e-3] * 7
    for t in [1.1e-3] * 6 + [2.0e-3] * 9:  # ...with 9 of 15 disturbed it would read 2.0
        costs.record(64, 0, t, tokens=64)
    assert abs(costs.plain[64] - 1.1e-3) < 1e-12
    for _ in range(3):
        costs.record(64, 2.0, 1.43e-3, tokens=150)
    assert abs(costs.per_token(64) - (1.43 / 1.1 - 1) / 2) < 1e-9


def test_acceptance_estimate_is_accepted_over_tried_drafts():
    """Independent acceptance at a = 0.62 verified 3 drafts at a time: the estimate is the
    accepted drafts over those tried (a rejection ends a verify's trials), close to 0.62.
    A running mean of each verify's own ratio reads ~0.45 here (a rejection at depth 1
    counts as 0 whatever the verify carried) and held batches at K=0."""
    import random

    rng = random.Random(1)
    pol = KPolicy(SpecConfig(num_tokens=3))
    ests = []
    for _ in range(200):
        s = seq_with_rate(None)
        for _ in range(12):
            acc = next((j for j in range(3) if rng.random() > 0.62), 3)
            pol.update(s, drafted=3, accepted=acc)
        ests.append(s.accept_rate)
    assert abs(sum(ests) / len(ests) - 0.62) < 0.04
    s = seq_with_rate(None)
    pol.update(s, drafted=4, accepted=2)  # 2 of 3 tried
    assert abs(s.accept_rate - 2 / 3) < 1e-12 and s.accept_counts == (2.0, 3.0)
    pol.update(s, drafted=4, accepted=4)  # 4 of 4
    assert abs(s.accept_rate - (0.7 * 2 + 4) / (0.7 * 3 + 4)) < 1e-12


def test_measured_throughput_overrules_a_model_that_predicts_a_loss():
    """Drafts priced dear (a whole plain step each) but drafting steps measured 1.2x plain
    tokens/s: a fused batch the model would hold at K=0 drafts at the model's best K above
    0 (1 at these prices); below WIN_FLOOR the model's K=0 stands."""
    from engine.spec.costs import StepCosts
    from engine.spec.policy import WIN_FLOOR

    costs = StepCosts()
    for _ in range(3):
        costs.record(4, 0, 1e-3, tokens=4)  # plain: 4000 tokens/s
    for _ in range(3):
        costs.record(4, 4.0, 5e-3, tokens=24)  # drafting: 4800 tokens/s, 1.0 per draft
    assert abs(costs.per_token(4) - 1.0) < 1e-9 and costs.measured_gain(4) >= WIN_FLOOR
    pol = KPolicy(SpecConfig(num_tokens=7))
    pol.costs = costs
    seqs = [seq_with_rate(0.6) for _ in range(4)]
    pol.begin_propose(PROBE_LEN + 1, batch_size=4)  # neither a plain nor a draft probe
    assert pol._best_k([0.6] * 4, 1.0, BATCH_START_MARGIN, 7, padded=True) == 0
    assert pol.choose_batch(seqs, 4) == 1 and pol.batch_why["winning"] == 1
    assert pol._best_k([0.6] * 4, 1.0, 0.0, 7, padded=True) == 1
    for _ in range(StepCosts.RATE_WINDOW):
        costs.record(4, 4.0, 5e-3, tokens=20)  # drafting now 4000 tokens/s: no win
    assert costs.measured_gain(4) < WIN_FLOOR
    assert pol.choose_batch(seqs, 4) == 0 and pol.batch_why["model_k0"] == 1
    pol.begin_propose(0, batch_size=4)  # a plain probe stays plain
    assert pol.choose_batch(seqs, 4) == 0 and pol.batch_why["probe"] == 1


def test_steps_switching_k_are_no_points_of_the_fit():
    """A fused step verifying one K's drafts and proposing another's (after a retry: 1
    verified, 2 proposed) costs far more than either K's steady steps. As a point of the fit
    at the line's shallow end it would make the slope <= 0, all of drafting read as a fixed
    part and the price per draft 0. Marked as a switch, it counts toward the measured
    tokens/s only."""
    from engine.spec.costs import StepCosts

    def costs_with_switches(marked: bool) -> StepCosts:
        costs = StepCosts()
        for _ in range(4):
            costs.record(1, 0, 1e-3, tokens=1)
        for level, ms in ((2.5, 1.35), (7.0, 1.8)):  # fixed 0.1, 0.1 per draft
            costs.record(1, level, ms * 1e-3, tokens=3, switch=True)  # the switch into K
            for _ in range(4):
                costs.record(1, level, ms * 1e-3, tokens=3)
        for _ in range(5):  # verify 1 draft 2, each a switch, each dear
            costs.record(1, 1.5, 2.6e-3, tokens=2, switch=marked)
        costs.record(1, 7.0, 1.8e-3, tokens=3)
        return costs

    costs = costs_with_switches(True)
    assert abs(costs.fixed_cost(1) - 0.1) < 1e-9 and abs(costs.per_token(1) - 0.1) < 1e-9
    # the switches' tokens count: the steady drafting steps (the first after plain ones is
    # a transition) are 4 of 3 tokens in 1.35 ms, 6 of 3 in 1.8 ms and the 5 of 2 in 2.6
    # ms, against 1 token a ms (2.6 ms is under STALL times the median, 1.8)
    rate = (10 * 3 + 5 * 2) / (4 * 1.35 + 6 * 1.8 + 5 * 2.6)
    assert abs(costs.measured_gain(1) - rate) < 1e-9
    unmarked = costs_with_switches(False)
    assert unmarked.per_token(1) == 0.0 and unmarked.fixed_cost(1) > 0.6


def test_a_losing_verdict_reads_recent_drafting_steps_only():
    """Drafting measured slower than plain holds a batch at K=0, where only probes draft. A
    verdict from drafting steps older than LOSING_FRESH lapses, and the model's K stands
    again, though the whole STALE window still reads a loss."""
    from engine.spec.costs import StepCosts
    from engine.spec.policy import LOSING_FRESH

    costs = StepCosts()
    for _ in range(3):
        costs.record(1, 0, 1e-3, tokens=1)  # plain: 1000 tokens/s
    costs.record(1, 2.5, 1.3e-3, tokens=1)
    for _ in range(6):
        costs.record(1, 2.5, 1.3e-3, tokens=1)  # a stretch that drafted badly
    pol = KPolicy(SpecConfig(num_tokens=7))
    pol.costs = costs
    seqs = [seq_with_rate(0.8)]
    pol.begin_propose(PROBE_LEN + 1, batch_size=1)  # neither a plain nor a draft probe
    assert pol.choose_batch(seqs, 1) == 0 and pol.batch_why["losing"] == 1
    for _ in range(LOSING_FRESH):
        costs.record(1, 0, 1e-3, tokens=1)  # held at K=0
    assert costs.measured_gain(1) < 1.0 and costs.measured_gain(1, LOSING_FRESH) is None
    assert pol.choose_batch(seqs, 1) > 0 and pol.batch_why["model"] == 1
    assert pol.choose(seqs[0], batch_size=1) > 0


def test_dense_levels_give_k5_its_own_price():
    """`SpecConfig.dense_levels_from`: levels grow by 2 past 4, so with K=7 a K=5 step runs 6
    verify rows and 6 chain steps, priced below K=7 and a candidate of the batch's pick."""
    from engine.spec.fused import levels

    assert levels(8) == (1, 2, 4, 8) and levels(7) == (1, 2, 4, 7)
    assert levels(8, 4) == (1, 2, 4, 6, 8) and levels(7, 4) == (1, 2, 4, 6, 7)
    assert levels(6, 4) == (1, 2, 4, 6) and levels(3, 4) == (1, 2, 3)
    pol = KPolicy(SpecConfig(num_tokens=7, verify_token_budget=0))
    pol.levels = (levels(8, 4), (0, *levels(7, 4)))
    assert [pol.paid(k) for k in range(8)] == [0, 1, 2.5, 3.5, 4.5, 5.5, 6.5, 7]
    assert any(pol._best_k([a] * 4, c, kmax=7, padded=True) == 5
               for a in np.linspace(0.3, 0.98, 35) for c in (0.02, 0.05, 0.1, 0.2))


def test_dense_levels_from_a_batch_size_price_each_batch_by_its_own_graphs():
    """`SpecConfig.dense_levels_min_batch`: below it a fused batch runs (and is priced by) the
    doubling levels, from it on the dense ones; so with the 384-token verify budget 64
    sequences may draft K=5 (6 rows) where the doubling levels hold them at K<=3, and 4
    sequences price K=5 as K=7. Graphs captured ahead are those a bucket's batches may run."""
    from engine.spec.fused import level_sets, level_wanted

    small, large = level_sets(7, 4, 32)
    assert small == ((1, 2, 4, 8), (0, 1, 2, 4, 7))
    assert large == ((1, 2, 4, 6, 8), (0, 1, 2, 4, 6, 7))
    assert level_sets(7, 4, 0) == (large, large) == level_sets(7, 4, 1)
    assert level_sets(7, None, 0)[0] == level_sets(7, None, 0)[1] == small
    # (draft level, verify rows, a bucket's batch sizes lo..hi): bucket 17..32 holds batches
    # on both sides of 32, 33..48 only large ones, 1..16 only small ones
    wanted = functools.partial(level_wanted, small, large, 32)
    assert wanted(6, 6, 17, 32) and wanted(7, 8, 17, 32) and wanted(7, 8, 1, 16)
    assert not wanted(6, 6, 1, 16) and not wanted(7, 6, 1, 16)  # 6 rows, 7 drafts: never
    assert wanted(6, 8, 33, 48) and wanted(0, 6, 33, 48) and not wanted(0, 6, 1, 16)

    pol = KPolicy(SpecConfig(num_tokens=7, dense_levels_from=4, dense_levels_min_batch=32))
    pol.levels, pol.levels_at = small, (lambda b: large if b >= 32 else small)
    assert pol._kmax(64, padded=True) == 5 and pol._kmax(48, padded=True) == 7
    assert [pol.paid(k, batch_size=64) for k in range(8)] == [0, 1, 2.5, 3.5, 4.5, 5.5, 6.5, 7]
    assert [pol.paid(k, batch_size=4) for k in range(8)] == [0, 1, 2.5, 3.5, 5.5, 7, 7, 7]
    assert pol.paid(5) == 7  # no batch size: the smallest batches' levels
    seqs = [seq_with_rate(0.9) for _ in range(64)]
    pol.begin_propose(PROBE_LEN + 1, batch_size=64)
    assert pol.choose_batch(seqs, 64) == 5
    # without the dense levels 64 sequences stop at K=3
    plain = KPolicy(SpecConfig(num_tokens=7))
    plain.levels = small
    plain.begin_propose(PROBE_LEN + 1, batch_size=64)
    assert plain.choose_batch(seqs, 64) == 3
    with pytest.raises(ValueError, match="dense_levels_min_batch"):
        SpecConfig(dense_levels_min_batch=8)
    with pytest.raises(ValueError, match="dense_levels_min_batch"):
        SpecConfig(dense_levels_from=4, dense_levels_min_batch=-1)


def test_measured_win_drafts_at_the_best_measured_level():
    """win_pick "measured": where the measured win overrules the model's K=0, the batch
    drafts at the K of the level whose steps emitted the most tokens per second at its bucket
    (the deepest K of that level), not at the model's K=1; "model" keeps K=1."""
    from engine.spec.costs import StepCosts

    costs = StepCosts()
    for _ in range(3):
        costs.record(4, 0, 1e-3, tokens=4)  # plain: 1 token a sequence per ms
    for _ in range(3):
        costs.record(4, 1.0, 1.4e-3, tokens=7)  # level 1: 1.25 a sequence per ms
    for _ in range(3):
        costs.record(4, 3.5, 2e-3, tokens=12)  # level 3.5: 1.5
    for _ in range(3):
        costs.record(4, 7.0, 3e-3, tokens=14)  # level 7: 1.17
    assert costs.best_level(4) == 3.5 and costs.best_level(3) == 3.5
    assert costs.best_level(8) is None  # another bucket
    seqs = [seq_with_rate(0.3) for _ in range(4)]
    for pick, want in (("model", 1), ("measured", 3)):
        pol = KPolicy(SpecConfig(num_tokens=7, win_pick=pick))
        pol.costs, pol.levels = costs, ((1, 2, 4, 8), (0, 1, 2, 4, 7))
        assert pol._measured_k(4, 7) == 3 and pol._measured_k(4, 2) == 2
        pol.begin_propose(PROBE_LEN + 1, batch_size=4)
        assert pol.choose_batch(seqs, 4) == want and pol.batch_why["winning"] == 1
    with pytest.raises(ValueError, match="win_pick"):
        SpecConfig(win_pick="best")


def test_batch_k_holds_one_k_but_keeps_the_measured_loss_check():
    """batch_k: every fused batch drafts that K (capped by the verify budget) whatever the
    model says, plain probes still run plain, and drafting measured slower than plain puts
    the batch at K=0."""
    from engine.spec.costs import StepCosts

    pol = KPolicy(SpecConfig(num_tokens=7, verify_token_budget=0, batch_k=5))
    seqs = [seq_with_rate(0.05) for _ in range(4)]  # the model alone would say K=0
    pol.begin_propose(PROBE_LEN + 1, batch_size=4)
    assert pol.choose_batch(seqs, 4) == 5 and pol.batch_why["fixed"] == 1
    pol.begin_propose(0, batch_size=4)  # a plain probe
    assert pol.choose_batch(seqs, 4) == 0
    costs = StepCosts()
    for _ in range(3):
        costs.record(4, 0, 1e-3, tokens=4)
    for _ in range(3):
        costs.record(4, 5.0, 3e-3, tokens=8)  # drafting: 2/3 of plain's tokens/s
    pol.costs = costs
    pol.begin_propose(PROBE_LEN + 1, batch_size=4)
    assert pol.choose_batch(seqs, 4) == 0 and pol.batch_why["losing"] == 1
    for bad in (-1, 8):
        with pytest.raises(ValueError, match="batch_k"):
            SpecConfig(num_tokens=7, batch_k=bad)
    with pytest.raises(ValueError, match="dense_levels_from"):
        SpecConfig(dense_levels_from=1)


def test_plain_probes_space_out_where_drafting_wins_by_far():
    """Where drafting measured PROBE_RELAX_GAIN times plain decoding's tokens/s or more,
    plain probes come PROBE_RELAX times further apart; near the break-even they keep
    PLAIN_PROBE_EVERY."""
    from engine.spec import policy

    def probe_steps(draft_tokens):
        pol = KPolicy(SpecConfig(num_tokens=5))
        for _ in range(3):
            pol.costs.record(1, 0, 1e-3, tokens=1)  # plain: 1000 tokens/s
        for _ in range(3):
            pol.costs.record(1, 3.0, 1.5e-3, tokens=draft_tokens)
        out = []
        for step in range(4 * policy.PLAIN_PROBE_EVERY * policy.PROBE_RELAX):
            pol.begin_propose(step, batch_size=1)
            out.append(pol.plain_probe)
        return sum(out), pol.costs.measured_gain(1)

    far, gain = probe_steps(4)  # 2667 tokens/s
    assert gain >= policy.PROBE_RELAX_GAIN
    near, gain = probe_steps(2)  # 1333 tokens/s
    assert gain < policy.PROBE_RELAX_GAIN
    assert near == 4 * policy.PROBE_RELAX * PROBE_LEN and far == 4 * PROBE_LEN
