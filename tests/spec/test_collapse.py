"""The acceptance-collapse detector (`engine.spec.collapse`): drafts that stop being accepted
turn speculation off (K=0 but for sparse probes) with a log line and a metric; acceptance that
comes back turns it on again; output stays the engine's greedy output throughout."""

from __future__ import annotations

import logging
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, SamplingParams
from engine.config import SpecConfig
from engine.metrics import Metrics
from engine.spec import collapse
from engine.spec.collapse import CollapseWatch
from engine.testing import random_head, tiny_engine


def test_the_watch_goes_off_below_break_even_and_back_on_above_it(caplog):
    w = CollapseWatch(1.5, depths=4)
    for _ in range(80):  # 4 drafts, 3 accepted: 4 tokens a verify
        w.record(4, 3)
    assert not w.collapsed and w.length > 3.5 and w.allows()
    with caplog.at_level(logging.WARNING, "tandem.engine"):
        for _ in range(200):  # nothing accepted
            w.record(4, 0)
            if w.collapsed:
                break
    assert w.collapsed and w.collapses == 1
    assert "speculation off" in caplog.text and "below break-even 1.50" in caplog.text
    allowed = sum(w.allows() for _ in range(10 * collapse.PROBE_EVERY))
    assert allowed == 10  # only probes draft while off
    for _ in range(collapse.RECOVER_VERIFIES + 2):  # probes see acceptance again
        w.record(4, 4)
    assert not w.collapsed and w.collapses == 1 and "back on" in caplog.text


def test_a_zero_break_even_never_turns_speculation_off():
    w = CollapseWatch(0.0, depths=3)
    for _ in range(500):
        w.record(3, 0)
    assert not w.collapsed and w.allows()


def test_per_position_acceptance_counts_only_positions_tried():
    w = CollapseWatch(1.1, depths=3)
    w.record(3, 1)  # position 0 accepted, 1 rejected, 2 never tried
    assert w.tried == [1.0, 1.0, 0.0] and w.passed == [1.0, 0.0, 0.0]


def _engine(base, head, below: float) -> Engine:
    cfg = replace(base.config, spec=SpecConfig(num_tokens=3, dynamic=False,
                                               collapse_below=below))
    return Engine(cfg, weights_of=base, draft_head=head)


def test_a_random_head_collapses_and_output_stays_lossless(caplog):
    """A random head's drafts are almost never accepted: with a break-even the engine stops
    drafting (fixed K=3 too) and says so; the tokens are the plain engine's all along."""
    base = tiny_engine(0, max_num_batched_tokens=64)
    head = random_head(base)
    prompts = [[(5 * i + j) % 50 + 1 for j in range(6)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = [c.token_ids for c in base.generate(prompts, sp)]
    watched = _engine(base, head, below=1.5)
    m = Metrics("decode")
    m.watch_engine(watched)
    with caplog.at_level(logging.WARNING, "tandem.engine"):
        got = [c.token_ids for c in watched.generate(prompts, sp)]
    assert got == plain
    watch = watched.spec.policy.watch
    assert watch.collapses >= 1 and "speculation off" in caplog.text
    values = {(f.name, sm.name): sm.value for f in text_string_to_metric_families(
        m.exposition().decode()) for sm in f.samples}
    assert values[("tandem_spec_collapses", "tandem_spec_collapses_total")] == watch.collapses
    assert values[("tandem_spec_collapsed", "tandem_spec_collapsed")] == float(watch.collapsed)
    unwatched = _engine(base, head, below=0.0)
    assert [c.token_ids for c in unwatched.generate(prompts, sp)] == plain
    assert unwatched.spec.policy.watch.collapses == 0
    # drafting stopped: far fewer drafts than the engine that kept drafting at K=3
    drafted = sum(watched.spec.stats.drafted_per_pos)
    assert drafted < 0.6 * sum(unwatched.spec.stats.drafted_per_pos)
