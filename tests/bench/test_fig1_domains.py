"""Figure 1's headline (bench/fig1_single_stream.py): the engine's default speculation
against none and against the --fig1-domain-variants challengers on each domain's held-out
split, per-position acceptance, time to ready and the first request; every derived field and
goal follows from the measured numbers."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

import pytest

from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

DOMAINS = ("code", "math")
CHALLENGER = "eagle3_k7_context"


def test_per_position_counts_the_verifies_between_two_readings():
    from bench.fig1_single_stream import per_position

    before = ([0, 2, 0, 1], [1, 1, 1, 0])
    # since then: one verify of 1 draft, three of 3; accepted 0, 1, 2 and 3 drafts
    after = ([0, 3, 0, 4], [2, 2, 2, 1])
    got = per_position(before, after)
    assert got["verify_steps"] == 4
    assert got["per_position_acceptance"] == [0.75, 0.5, 0.25]
    assert got["per_position_drafted"] == [1.0, 0.75, 0.75]
    assert got["per_position_given_drafted"] == [0.75, 0.667, 0.333]
    assert per_position(None, None) == {} and per_position(before, before) == {}


def summary_input(default_tps: dict) -> dict:
    rows = {d: {"no_spec": {"tokens_per_s": 100.0},
                "engine_default": {"tokens_per_s": t, "acceptance_length": 3.0,
                                   "per_position_acceptance": [0.9, 0.5]}}
            for d, t in default_tps.items()}
    return {"config": {"engine_default_spec": {"num_tokens": 2}}, "domains": rows,
            "ready": {"first_over_steady": 1.1}, "goals": {"kept": True}}


def test_the_headline_and_goals_follow_from_each_domains_numbers():
    from bench.fig1_single_stream import domain_summary

    res = summary_input({"code": 320.0, "math": 260.0})
    outs = {"code": {"engine_default": [[1, 2], [3, 4]], "no_spec": [[1, 2], [3, 0]]}}
    domain_summary(res, outs)
    code, math = res["domains"]["code"], res["domains"]["math"]
    assert (code["vs_no_spec"], math["vs_no_spec"]) == (3.2, 2.6)
    assert code["token_identical"] == {"identical": 1, "of": 2} and "token_identical" not in math
    assert code["per_position_acceptance"] == [0.9, 0.5] and code["acceptance_length"] == 3.0
    head = res["headline"]
    assert (head["best_domain"], head["best_vs_no_spec"], head["min_vs_no_spec"]) == \
        ("code", 3.2, 2.6)
    assert head["per_domain"]["math"] == {"no_spec": 100.0, "engine_default": 260.0,
                                          "vs_no_spec": 2.6, "acceptance_length": 3.0,
                                          "challengers": {}}
    assert head["challengers"] == {}
    assert res["goals"]["engine_default_best_across_domains"] is None
    goals = res["goals"]
    assert goals["engine_default_at_least_2.5x_no_spec_every_domain"] is True
    assert goals["engine_default_best_domain_above_3x"] is True
    assert goals["first_request_within_1.2x_steady"] is True and goals["kept"] is True

    # a domain below the goal, or one that did not measure, fails it
    res = summary_input({"code": 280.0, "math": 240.0})
    domain_summary(res, {})
    assert res["goals"]["engine_default_at_least_2.5x_no_spec_every_domain"] is False
    assert res["goals"]["engine_default_best_domain_above_3x"] is False
    res = summary_input({"code": 320.0, "math": 260.0})
    res["domains"]["math"]["engine_default"] = {"error": "Traceback ..."}
    domain_summary(res, {})
    assert res["goals"]["engine_default_at_least_2.5x_no_spec_every_domain"] is False
    assert res["headline"]["min_vs_no_spec"] == 3.2


@pytest.fixture(scope="module")
def fig1(tmp_path_factory) -> dict:
    from bench import suite
    from cluster.soak_cluster import embedded_export

    out = tmp_path_factory.mktemp("fig1")
    code = suite.main(["--device", "cpu", "--figures", "1", "--model", embedded_export(),
                       "--num-blocks", "256", "--fig1-prompts", "1", "--fig1-tokens", "6",
                       "--fig1-hf-prompts", "1", "--fig1-domains", ",".join(DOMAINS),
                       "--fig1-domain-prompts", "2", "--fig1-table", "no_spec,engine_default",
                       "--fig1-domain-variants", CHALLENGER, "--out", str(out)])
    res = json.loads((out / "fig1_single_stream.json").read_text())
    # the plot ignores the challengers (skipped where matplotlib is not installed)
    assert res["png"].startswith(("fig1_single_stream.png", "skipped")), res["png"]
    assert code == 0 and "error" not in res and "domains_error" not in res, res
    return res


def test_each_domain_runs_both_variants_and_its_fields_follow_from_them(fig1):
    from bench.common import ratio
    from engine.config import SpecConfig

    k = SpecConfig().num_tokens
    assert fig1["config"]["engine_default_spec"] == asdict(SpecConfig())
    assert list(fig1["domains"]) == list(DOMAINS)
    for d, row in fig1["domains"].items():
        assert row["prompts"] == 2 and len(row["prompt_tokens"]) == 2
        mine, ref = row["engine_default"], row["no_spec"]
        assert mine["tokens"] == ref["tokens"] == 2 * 6, d
        assert row["vs_no_spec"] == ratio(mine["tokens_per_s"], ref["tokens_per_s"])
        assert 0 <= row["token_identical"]["identical"] <= row["token_identical"]["of"] == 2
        assert fig1["headline"]["per_domain"][d]["vs_no_spec"] == row["vs_no_spec"]
        pos = row["per_position_acceptance"]
        if "verify_steps" not in mine:  # dynamic K drafted nothing in so short a run
            assert pos is None, d
            continue
        assert pos == mine["per_position_acceptance"] and len(pos) == k
        assert all(a >= b for a, b in zip(pos, pos[1:])) and 0 <= pos[-1] <= pos[0] <= 1
        # every verify emits its accepted drafts and one token of the target's own
        assert row["acceptance_length"] == pytest.approx(1 + sum(pos), abs=2e-3)


def test_time_to_ready_first_request_and_goals_are_recorded(fig1):
    ready, goals = fig1["ready"], fig1["goals"]
    assert 0 < ready["load_s"] <= ready["total_s"] and ready["graphs_s"] >= 0
    assert ready["first_over_steady"] == pytest.approx(
        ready["first_request_s"] / ready["steady_request_s"], abs=2e-3)
    assert len(ready["steady_runs_s"]) == len(ready["compiles_per_request"]) - 1
    ratios = {d: r["vs_no_spec"] for d, r in fig1["domains"].items()}
    assert goals["engine_default_min_vs_no_spec"] == min(ratios.values())
    assert goals["engine_default_best_domain"] == max(ratios, key=ratios.get)
    assert goals["engine_default_at_least_2.5x_no_spec_every_domain"] == \
        (min(ratios.values()) >= 2.5)
    assert goals["engine_default_best_domain_above_3x"] == (max(ratios.values()) > 3)
    assert goals["first_request_within_1.2x_steady"] == (ready["first_over_steady"] <= 1.2)
    assert {"no_spec_at_least_1500_tok_s", "best_eagle3_vs_no_spec"} <= set(goals)


def with_challengers(default_tps: dict, challengers: dict) -> dict:
    """summary_input's result with each challenger's tokens/s per domain (None: it failed)."""
    res = summary_input(default_tps)
    res["config"]["domain_variants"] = list(challengers)
    for c, tps in challengers.items():
        for d, t in tps.items():
            res["domains"][d][c] = {"error": "Traceback ..."} if t is None else \
                {"tokens_per_s": t, "acceptance_length": 3.5}
    return res


def test_a_challenger_faster_on_every_domain_unseats_the_default():
    from bench.fig1_single_stream import domain_summary

    res = with_challengers({"code": 300.0, "math": 250.0},
                           {"fast": {"code": 330.0, "math": 275.0},
                            "slow": {"code": 150.0, "math": 200.0}})
    domain_summary(res, {})
    assert res["domains"]["code"]["fast"]["vs_default"] == 1.1
    head = res["headline"]
    assert head["per_domain"]["math"]["challengers"] == {
        "fast": {"tokens_per_s": 275.0, "vs_default": 1.1},
        "slow": {"tokens_per_s": 200.0, "vs_default": 0.8}}
    assert head["challengers"] == {
        "fast": {"beats_default_on": ["code", "math"], "min_vs_default": 1.1,
                 "mean_vs_default": 1.1},
        "slow": {"beats_default_on": [], "min_vs_default": 0.5, "mean_vs_default": 0.65}}
    assert res["goals"]["engine_default_best_across_domains"] is False


def test_a_challenger_faster_on_all_but_one_domain_leaves_the_default_best():
    from bench.fig1_single_stream import domain_summary

    res = with_challengers({"code": 300.0, "math": 250.0, "json": 200.0},
                           {"fast": {"code": 330.0, "math": 275.0, "json": 190.0}})
    domain_summary(res, {})
    assert res["headline"]["challengers"]["fast"]["beats_default_on"] == ["code", "math"]
    assert res["headline"]["challengers"]["fast"]["min_vs_default"] == 0.95
    assert res["goals"]["engine_default_best_across_domains"] is True

    # a domain the challenger failed on is not beaten there
    res = with_challengers({"code": 300.0, "math": 250.0},
                           {"fast": {"code": 330.0, "math": None}})
    domain_summary(res, {})
    assert res["headline"]["challengers"]["fast"] == {
        "beats_default_on": ["code"], "min_vs_default": 1.1, "mean_vs_default": 1.1}
    assert res["goals"]["engine_default_best_across_domains"] is True

    # no challenger measured: no verdict
    res = with_challengers({"code": 300.0}, {"fast": {"code": None}})
    domain_summary(res, {})
    assert res["goals"]["engine_default_best_across_domains"] is None


def parsed(*argv: str):
    import argparse

    from bench import suite

    p = argparse.ArgumentParser()
    suite.add_arguments(p)
    return p.parse_args(list(argv))


def test_domain_variants_are_the_tables_settings_by_name():
    from bench.common import engine_default
    from bench.fig1_single_stream import domain_variants, spec_variants

    args = parsed()
    spec = engine_default(args)
    table = spec_variants(args, spec)
    got = domain_variants(args, spec)
    assert list(got) == ["eagle3_k5_context", "eagle3_k7_context", "eagle3_dynamic_k7_context"]
    assert all(got[v] == table[v] for v in got)
    assert domain_variants(parsed("--fig1-domain-variants", ""), spec) == {}
    args = parsed("--fig1-domain-variants", "ngram_k5, eagle3_k5,ngram_k5")
    assert list(domain_variants(args, spec)) == ["ngram_k5", "eagle3_k5"]


@pytest.mark.parametrize("names", ["eagle3_k9", "eagle3_k5,no_spec", "engine_default"])
def test_an_unknown_domain_variant_fails_before_anything_runs(names, monkeypatch):
    from bench import fig1_single_stream as fig1

    def ran(*_a, **_k):
        raise AssertionError("ran before the names were checked")

    monkeypatch.setattr(fig1, "held_out_messages", ran)
    monkeypatch.setattr(fig1, "headline", ran)
    with pytest.raises(ValueError, match="--fig1-domain-variants: unknown"):
        fig1.fig_single_stream(parsed("--fig1-domain-variants", names), {})


def test_each_challenger_runs_on_every_domain_against_the_default(fig1):
    from bench.common import ratio

    assert fig1["config"]["domain_variants"] == [CHALLENGER]
    head, beats = fig1["headline"], []
    for d, row in fig1["domains"].items():
        mine, ref = row[CHALLENGER], row["engine_default"]
        assert mine["tokens"] == 2 * 6, d
        assert mine["vs_default"] == ratio(mine["tokens_per_s"], ref["tokens_per_s"])
        assert head["per_domain"][d]["challengers"][CHALLENGER] == {
            "tokens_per_s": mine["tokens_per_s"], "vs_default": mine["vs_default"]}
        if mine["tokens_per_s"] > ref["tokens_per_s"]:
            beats.append(d)
    vs = [r[CHALLENGER]["vs_default"] for r in fig1["domains"].values()]
    assert head["challengers"][CHALLENGER] == {
        "beats_default_on": beats, "min_vs_default": min(vs),
        "mean_vs_default": round(statistics.fmean(vs), 3)}
    assert fig1["goals"]["engine_default_best_across_domains"] == (beats != list(DOMAINS))
