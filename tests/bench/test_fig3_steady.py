"""Figure 3's steady measure (bench/suite.py): c streams always in flight, every finished
request replaced at once; with mixed lengths, output lengths drawn from one seeded list that
every variant shares."""

from __future__ import annotations

from types import SimpleNamespace

from engine import Engine


def test_mixed_lengths_are_seeded_and_spread_around_n():
    from bench.suite import mixed_lengths

    a, b = mixed_lengths(128, 300), mixed_lengths(128, 300)
    assert a == b and all(64 <= x <= 192 for x in a)
    assert len(set(a)) > 50 and 118 < sum(a) / len(a) < 138


def test_steady_run_admits_the_mixed_lengths_in_order(monkeypatch):
    """Every admitted request gets the next length of the list, the window ends when the
    last of 3c is admitted, and what was still running is aborted (all blocks back)."""
    from bench.suite import mixed_lengths, steady_throughput
    from tests.helpers import tiny_engine

    eng = tiny_engine(0)
    seen = []
    add = Engine.add_request

    def record(self, prompt, params, *a, **k):
        seen.append(params.max_tokens)
        return add(self, prompt, params, *a, **k)

    monkeypatch.setattr(Engine, "add_request", record)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    tps = steady_throughput(SimpleNamespace(device="cpu"), eng, prompts, 2, 6, mixed=True)
    assert tps > 0
    assert seen == mixed_lengths(6, 6)
    assert not eng.has_unfinished()
    eng.blocks.check_all_free()
