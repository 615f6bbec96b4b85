"""Dynamic K: speculate deeper when drafts land, back off to plain decoding when they don't."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.sequence import SamplingParams, Sequence
from engine.spec.policy import PROBE_EVERY, KPolicy


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
    s = seq_with_rate(None)
    for _ in range(20):
        KPolicy.update(s, drafted=4, accepted=4)
    high = s.accept_rate
    for _ in range(20):
        KPolicy.update(s, drafted=4, accepted=0)
    assert high > 0.95 and s.accept_rate < 0.05
