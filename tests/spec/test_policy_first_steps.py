"""Dynamic K's first decisions on a fresh engine: a few plain and drafting steps are all the
measurements there are, and a line fitted through so few points must not hold a sequence at
K=0 while drafting measures faster than plain."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.sequence import SamplingParams, Sequence
from engine.spec.costs import StepCosts
from engine.spec.policy import PROBE_LEN, WIN_FLOOR, KPolicy


def seq_with_rate(rate):
    s = Sequence([1, 2, 3], SamplingParams())
    s.accept_rate = rate
    return s


def first_steps() -> StepCosts:
    """A fresh engine's first decode steps at one stream on a CPU (milliseconds as timed):
    plain steps (the first a transition), the switch into drafting, then three drafting
    steps, the last verifying 3 drafts and proposing 1 (level 2.0) and, its verify rows
    costing as a deep level's, dear for its level."""
    costs = StepCosts()
    costs.untimed(1, 0.28, "prefill")
    costs.record(1, 0, 53e-3, tokens=1)
    costs.record(1, 0, 49e-3, tokens=1)
    costs.record(1, 0, 50e-3, tokens=1)
    costs.record(1, 1.5, 57e-3, tokens=1)
    costs.record(1, 4.0, 107e-3, tokens=4)
    costs.record(1, 4.0, 101e-3, tokens=3)
    costs.record(1, 2.0, 96e-3, tokens=1)
    return costs


def test_a_young_fit_does_not_stop_a_winning_sequence():
    """The first steps' line reads most of drafting as a fixed part (the dear level-2 step),
    so the model alone would hold a sequence whose acceptance dipped (0.48) at K=0; drafting
    measured over WIN_FLOOR times plain tokens/s keeps it drafting at the model's best K."""
    costs = first_steps()
    assert costs.fixed_cost(1) > 0.5 and costs.measured_gain(1) >= WIN_FLOOR
    pol = KPolicy(SpecConfig())
    pol.costs = costs
    pol.begin_propose(PROBE_LEN + 3, batch_size=1)  # neither a plain nor a draft probe
    fixed, per = pol._cost(1, False)
    assert pol._best_k([0.48], per, kmax=5, fixed=fixed) == 0  # the model's own pick
    assert pol.choose(seq_with_rate(0.48), batch_size=1) > 0


def test_a_measured_loss_still_stops_drafting():
    """The same first steps with drafting measured below plain: K=0, as before."""
    costs = StepCosts()
    for _ in range(3):
        costs.record(1, 0, 49e-3, tokens=1)
    costs.record(1, 1.5, 57e-3, tokens=1)
    costs.record(1, 4.0, 107e-3, tokens=1)
    costs.record(1, 4.0, 101e-3, tokens=2)
    assert costs.measured_gain(1) < 1.0
    pol = KPolicy(SpecConfig())
    pol.costs = costs
    pol.begin_propose(PROBE_LEN + 3, batch_size=1)
    assert pol.choose(seq_with_rate(0.9), batch_size=1) == 0


def test_seeded_sampled_requests_ignore_a_measured_win():
    """A seeded sampled request's K depends on no timing: the model's pick stands."""
    pol = KPolicy(SpecConfig(verify_token_cost=0.5, draft_step_cost=0.5))
    pol.costs = first_steps()
    pol.begin_propose(PROBE_LEN + 3, batch_size=1)
    seeded = Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=7))
    seeded.accept_rate = 0.3
    assert pol.choose(seeded, batch_size=1) == 0
