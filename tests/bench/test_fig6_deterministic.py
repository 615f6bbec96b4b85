"""Figure 6 end to end at tiny size on the CPU (a random tiny model, fp32): every comparison
and the cost table land in the JSON, and the deterministic side is identical everywhere."""

from __future__ import annotations

import json

import pytest

from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

SMOKE_ROWS = {"eagle3_default", "streams8_staggered_no_spec", "streams8_staggered_eagle3",
              "streams4_staggered_eagle3", "sampled_eagle3",
              "sampled_streams8_staggered_no_spec", "sampled_streams8_staggered_eagle3",
              "prefix_cache_hit", "chunked_prefill", "disaggregated", "restarted_process",
              "ngram_k5", "eagle3_k1", "eagle3_k7"}


def run_fig6(out, *extra: str) -> dict:
    from bench import suite

    code = suite.main(["--device", "cpu", "--figures", "6", "--fig6-smoke", "--out", str(out),
                       *extra])
    res = json.loads((out / "fig6_deterministic.json").read_text())
    assert code == 0 and "error" not in res, res.get("error")
    return res


@pytest.fixture(scope="module")
def fig6(tmp_path_factory) -> dict:
    return run_fig6(tmp_path_factory.mktemp("fig6"))


def test_every_comparison_ran_in_both_modes_and_the_deterministic_side_is_identical(fig6):
    rows = fig6["comparisons"]
    assert set(rows) == SMOKE_ROWS and fig6["skipped_comparisons"] == []
    for name, row in rows.items():
        for mode in ("deterministic", "default"):
            assert row[mode]["of"] > 0 and 0 <= row[mode]["identical"] <= row[mode]["of"], name
        assert row["deterministic"]["identical"] == row["deterministic"]["of"], (name, row)
    assert rows["streams8_staggered_no_spec"]["deterministic"]["of"] == 8  # prompts cycled
    assert rows["prefix_cache_hit"]["deterministic"]["prefix_hit_tokens"] > 0
    for name in ("eagle3_default", "eagle3_k7", "ngram_k5"):  # the speculation ran
        assert rows[name]["deterministic"]["acceptance_length"] is not None, name
    assert len(fig6["references"]["deterministic"]["digests"]) == fig6["config"]["prompts"]


def test_the_cost_table_and_goals_are_recorded(fig6):
    for streams in ("streams_1", "streams_8"):
        for spec in ("no_spec", "eagle3"):
            cell = fig6["cost"][streams][spec]
            assert cell["deterministic"] > 0 and cell["default"] > 0
            assert cell["deterministic_over_default"] == pytest.approx(
                cell["deterministic"] / cell["default"], abs=2e-3)
    goals = fig6["goals"]
    assert goals["deterministic_100pct_identical"] is True and goals["comparisons_failed"] == []
    assert goals["deterministic_identical"].split("/")[0] == \
        goals["deterministic_identical"].split("/")[1]
    assert {"cost_at_most_10pct", "cost_at_most_5pct",
            "deterministic_min_speed_vs_default"} <= set(goals)
    assert fig6["command"] and fig6["date"] and fig6["environment"]["torch"]


def test_held_out_prompts_rise_in_length_and_some_share_a_long_prefix():
    from bench.common import SHARE_EVERY, code_tasks

    prompts, shared = code_tasks(8, 64, 1200, lambda text: list(text.encode()))
    own = [len(p) for i, p in enumerate(prompts) if shared[i] is None]
    assert own[-1] > 4 * own[0] and max(own) <= 1200
    assert shared == [i - 1 if i % SHARE_EVERY == SHARE_EVERY - 1 else None for i in range(8)]
    a, b = prompts[6], prompts[7]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > len(a) // 2  # the context both ask about


def test_comparisons_past_the_deadline_are_skipped_and_listed(tmp_path):
    res = run_fig6(tmp_path, "--fig6-deadline-s", "0")
    assert res["comparisons"] == {}
    assert set(res["skipped_comparisons"]) == SMOKE_ROWS | {"cost"}
    assert res["goals"]["deterministic_100pct_identical"] is False  # nothing was shown
