"""Figure 3's headline (bench/fig3_concurrency.py): the engine's default speculation against
none at every concurrency and measure, and each challenger against the default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.fig3_concurrency import concurrency_summary

DYN = "eagle3_dynamic_k7"


def row(c: int, burst: float, steady: float | None = None, mixed: float | None = None) -> dict:
    return {"concurrency": c, "tokens_per_s": burst,
            "steady_tokens_per_s": burst if steady is None else steady,
            "steady_mixed_tokens_per_s": burst if mixed is None else mixed}


def fig3(default: list, k5: list, dyn: list, no_spec=(100.0, 200.0, 400.0), **more) -> dict:
    """A figure 3 result of made-up rows at 1, 2 and 4 streams: each variant's tokens/s per
    concurrency, the same in every measure unless a tuple (burst, steady, mixed) is given."""
    def rows(xs):
        return [row(c, *(x if isinstance(x, tuple) else (x,))) for c, x in zip((1, 2, 4), xs)]

    runs = {"no_spec": rows(no_spec), "engine_default": rows(default),
            "eagle3_k5": rows(k5), DYN: rows(dyn)}
    runs.update({k: rows(v) for k, v in more.items()})
    return {"runs": runs}


def test_the_goals_judge_the_default_against_no_speculation_in_every_measure():
    # the default at 0.96x no speculation in the steady measure at 2 streams only
    res = fig3([150.0, (300.0, 192.0, 300.0), 600.0], [140.0] * 3, [120.0] * 3)
    concurrency_summary(res, [])
    goals = res["goals"]
    assert goals["engine_default_at_least_0.97x_no_spec_everywhere_burst"] is True
    assert goals["engine_default_at_least_0.97x_no_spec_everywhere_steady"] is False
    assert goals["engine_default_at_least_0.97x_no_spec_everywhere_steady_mixed"] is True
    assert goals["engine_default_min_ratio_burst"] == 1.5
    assert goals["engine_default_min_ratio_steady"] == 0.96
    assert not any(k.startswith("dynamic_") for k in goals)
    # the default's ratios sit beside the other variants', per row and per measure
    assert res["ratio_vs_no_spec"]["engine_default"] == {"1": 1.5, "2": 1.5, "4": 1.5}
    assert res["steady_ratio_vs_no_spec"]["engine_default"]["2"] == 0.96
    assert set(res["steady_mixed_ratio_vs_no_spec"]) == {"engine_default", "eagle3_k5", DYN}
    assert res["runs"]["engine_default"][1]["steady_vs_no_spec"] == 0.96
    assert "vs_default" not in res["runs"]["engine_default"][0]
    assert "vs_no_spec" not in res["runs"]["no_spec"][0]


def test_challengers_are_summed_up_per_measure_against_the_default():
    res = fig3([150.0, 300.0, 600.0], [165.0, 270.0, 600.0],
               [(120.0, 330.0, 150.0), (240.0, 330.0, 150.0), (480.0, 330.0, 150.0)])
    concurrency_summary(res, [])
    k5, dyn = res["challengers"]["eagle3_k5"], res["challengers"][DYN]
    assert set(res["challengers"]) == {"eagle3_k5", DYN}
    # equal is not faster
    assert k5["burst"] == {"beats_default_on": ["1"], "min_vs_default": 0.9,
                           "mean_vs_default": 1.0}
    assert dyn["burst"]["beats_default_on"] == [] and dyn["burst"]["min_vs_default"] == 0.8
    assert dyn["steady"]["beats_default_on"] == ["1", "2"]
    assert dyn["steady"]["min_vs_default"] == 0.55
    assert dyn["steady_mixed"]["beats_default_on"] == []  # equal is not faster
    assert res["runs"][DYN][0]["steady_vs_default"] == 2.2
    assert res["runs"]["eagle3_k5"][1]["vs_default"] == 0.9
    assert res["goals"]["engine_default_best_across_concurrencies"] is True


def test_a_challenger_faster_everywhere_in_every_measure_beats_the_default():
    res = fig3([150.0, 300.0, 600.0], [151.0, 301.0, 601.0], [100.0] * 3)
    concurrency_summary(res, [])
    assert res["challengers"]["eagle3_k5"]["steady_mixed"]["beats_default_on"] == ["1", "2", "4"]
    assert res["goals"]["engine_default_best_across_concurrencies"] is False


@pytest.mark.parametrize("where", [0, 1, 2])
def test_one_measure_where_the_default_holds_keeps_it_best(where):
    """Faster at every concurrency in two measures, not in the third: the default stays best
    (the goal asks for every concurrency in every measure, as figure 1 asks every domain)."""
    fast = [151.0, 301.0, 601.0]
    k5 = [tuple(150.0 * 2 ** i if m == where else x for m in range(3))
          for i, x in enumerate(fast)]
    res = fig3([150.0, 300.0, 600.0], k5, [100.0] * 3)
    concurrency_summary(res, [])
    assert res["goals"]["engine_default_best_across_concurrencies"] is True


def test_one_concurrency_where_the_default_holds_keeps_it_best():
    res = fig3([150.0, 300.0, 600.0], [151.0, 300.0, 601.0], [100.0] * 3)
    concurrency_summary(res, [])
    assert res["challengers"]["eagle3_k5"]["burst"]["beats_default_on"] == ["1", "4"]
    assert res["goals"]["engine_default_best_across_concurrencies"] is True


def test_candidates_challenge_the_default_and_keep_their_goals():
    res = fig3([150.0, 300.0, 600.0], [100.0] * 3, [100.0] * 3,
               engine_default_candidate=[160.0, 320.0, 640.0],
               engine_default_candidate2=[90.0, 300.0, 600.0])
    concurrency_summary(res, ["candidate", "candidate2"])
    goals = res["goals"]
    assert goals["candidate_min_ratio_burst"] == 1.6
    assert goals["candidate2_min_ratio_steady"] == 0.9
    assert res["challengers"]["engine_default_candidate"]["burst"]["beats_default_on"] == \
        ["1", "2", "4"]
    assert goals["engine_default_best_across_concurrencies"] is False
    assert res["ratio_vs_no_spec"]["engine_default_candidate2"]["1"] == 0.9


def test_an_unmeasured_rate_fails_the_goal_and_is_not_beaten():
    res = fig3([150.0, 300.0, 600.0], [151.0, 301.0, 601.0], [100.0] * 3)
    res["runs"]["engine_default"][2]["steady_tokens_per_s"] = None
    res["runs"]["eagle3_k5"][2]["steady_tokens_per_s"] = None
    concurrency_summary(res, [])
    assert res["goals"]["engine_default_at_least_0.97x_no_spec_everywhere_steady"] is False
    assert res["goals"]["engine_default_min_ratio_steady"] is None
    assert res["challengers"]["eagle3_k5"]["steady"]["beats_default_on"] == ["1", "2"]
    assert res["goals"]["engine_default_best_across_concurrencies"] is True


def test_the_default_runs_the_engines_default_and_candidates_change_it():
    from bench.common import engine_default
    from bench.fig3_concurrency import candidate_variants
    from engine.config import SpecConfig

    assert engine_default(SimpleNamespace(head=None)) == SpecConfig()
    assert engine_default(SimpleNamespace(head="/tmp/h")) == SpecConfig(head="/tmp/h")
    got = candidate_variants("engine_default", ["num_tokens=7", "context_drafts=False"])
    assert got == {"engine_default_candidate": {"num_tokens": 7},
                   "engine_default_candidate2": {"context_drafts": False}}


def test_the_plot_draws_the_default():
    """Both panels carry the default's lines, drawn apart from its challengers' (matplotlib's
    calls recorded on stand-in axes)."""
    from bench.fig3_concurrency import plot_concurrency

    class Axes:
        def __init__(self):
            self.lines = []

        def plot(self, xs, ys, fmt, label=None, **kw):
            self.lines.append((label, ys, kw))

        def __getattr__(self, name):  # set_xscale, legend, axhline, ...
            return lambda *a, **k: None

    axes = (Axes(), Axes())
    res = fig3([150.0, 300.0, 600.0], [140.0] * 3, [120.0] * 3)
    concurrency_summary(res, [])
    plot_concurrency(SimpleNamespace(subplots=lambda *a, **k: (None, axes)), res)
    lines = {label: (ys, kw) for label, ys, kw in axes[1].lines}
    assert lines["engine_default steady mixed"][0] == [1.5, 1.5, 1.5]
    assert lines["engine_default burst"][1]["c"] != lines["eagle3_k5 burst"][1]["c"]
    assert "engine_default burst" in [label for label, _, _ in axes[0].lines]
    assert "no_spec burst" not in lines
