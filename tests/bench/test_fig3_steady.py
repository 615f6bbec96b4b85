"""Figure 3's steady measure (bench/suite.py): c streams always in flight, every finished
request replaced at once; with mixed lengths, output lengths drawn from one seeded list that
every variant shares."""

from __future__ import annotations

from types import SimpleNamespace

from engine import Engine


def test_mixed_lengths_are_seeded_and_spread_around_n():
    from bench.fig3_concurrency import mixed_lengths

    a, b = mixed_lengths(128, 300), mixed_lengths(128, 300)
    assert a == b and all(64 <= x <= 192 for x in a)
    assert len(set(a)) > 50 and 118 < sum(a) / len(a) < 138


def test_steady_run_admits_the_mixed_lengths_in_order(monkeypatch):
    """Every admitted request gets the next length of the list, the window ends when the
    last of 3c is admitted, and what was still running is aborted (all blocks back)."""
    from bench.fig3_concurrency import mixed_lengths, steady_throughput
    from engine.testing import tiny_engine

    eng = tiny_engine(0)
    seen = []
    add = Engine.add_request

    def record(self, prompt, params, *a, **k):
        seen.append(params.max_tokens)
        return add(self, prompt, params, *a, **k)

    monkeypatch.setattr(Engine, "add_request", record)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    run = steady_throughput(SimpleNamespace(device="cpu"), eng, prompts, 2, 6, mixed=True)
    assert run.tokens_per_s > 0 and run.stalls["steps"] > 0
    assert seen == mixed_lengths(6, 6)
    assert not eng.has_unfinished()
    eng.blocks.check_all_free()


def test_outputs_of_an_earlier_runs_requests_admit_nothing():
    """The first step of a run may return outputs an abort at the end of the run before
    carried over (the drain of its step in flight): a finish among them is not one of this
    run's, so it admits no extra stream and its tokens do not count."""
    from bench.fig3_concurrency import steady_run
    from engine.output import RequestOutput
    from engine.testing import tiny_engine

    eng = tiny_engine(0)
    eng._carry.append(RequestOutput("earlier", [1, 2, 3], "", True, "length"))
    most, add = [0], eng.add_request

    def counted(*a, **k):
        rid = add(*a, **k)
        most[0] = max(most[0], len(eng.scheduler.running) + len(eng.scheduler.waiting))
        return rid

    eng.add_request = counted
    tokens, live = steady_run(eng, [[5, 6, 7]], 2, [4] * 6)
    assert most[0] == 2 and len(live) == 2
    # Four requests finished (4 tokens each); the two still running made some tokens too.
    assert 16 <= tokens < 16 + 2 * 4


def test_stalls_are_steps_far_above_the_median():
    from bench.fig3_concurrency import stalls

    st = stalls([0.001] * 20 + [0.0029, 0.004, 0.010])
    assert st["steps"] == 23 and st["stalls"] == 2 and st["max_step_ms"] == 10.0
    assert st["stalled_ms"] == 12.0 and st["median_step_ms"] == 1.0
    assert stalls([])["stalls"] == 0


def test_fig3_trace_records_what_dynamic_k_saw():
    """--fig3-trace: a dynamic-K engine's cost model records every step it is offered in a
    window (batch size, drafts per sequence, ms, tokens, path, timed), and stops after;
    engines without dynamic K record nothing."""
    from bench.fig3_concurrency import steady_throughput, take_trace, trace_start
    from engine.config import SpecConfig
    from engine.testing import tiny_engine

    eng = tiny_engine(0, spec=SpecConfig(method="ngram", num_tokens=2, dynamic=True))
    args = SimpleNamespace(device="cpu", fig3_trace=True)
    assert trace_start(args, eng)
    run = steady_throughput(args, eng, [[5, 6, 7, 5, 6, 7], [8, 9, 10, 11]], 2, 6)
    trace = take_trace(eng)
    assert eng.spec.policy.costs.trace is None
    assert len(trace) >= run.stalls["steps"] > 0
    assert all(len(t) == 6 and t[0] in (1, 2) and t[2] > 0 for t in trace)
    assert {t[4] for t in trace} <= {"fresh", "overlapped"}
    assert not trace_start(SimpleNamespace(fig3_trace=False), eng)
    assert not trace_start(args, tiny_engine(0))


def test_host_probe_reports_both_speeds():
    """Figure 3's host probe: per-call microseconds of a Python loop and a host torch op,
    each a best of stretches (positive, and a torch op dispatch costs more than a loop
    iteration)."""
    from bench.fig3_concurrency import host_probe_us

    p = host_probe_us(reps=200)
    assert set(p) == {"python_loop_us", "torch_op_us"}
    assert 0 < p["python_loop_us"] < p["torch_op_us"] < 1000


def test_variants_take_turns_in_rotated_order():
    """Figure 3's repetitions: every variant runs once per repetition, and each takes every
    position (first, after another variant's run, last) as the order rotates."""
    from bench.fig3_concurrency import turns

    names = ["no_spec", "eagle3_k5", "eagle3_dynamic_k7"]
    orders = [turns(names, rep) for rep in range(3)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert {o[0] for o in orders} == set(names) and {o[-1] for o in orders} == set(names)
    assert turns(names, 3) == turns(names, 0) == names
    assert turns([], 1) == []
