"""bench.trace_replay: figure 3's dynamic-K traces read back through the cost model."""

from __future__ import annotations

import json

from bench.trace_replay import main, replay


def _trace():
    # (batch, drafts per sequence, ms, tokens, how, timed?) as StepCosts.trace records them
    plain = [(2, 0.0, 0.5, 2, "overlapped", True)] * 6
    k1 = [(2, 1.0, 0.75, 3, "overlapped", True)] * 6
    k7 = [(2, 7.0, 1.0, 8, "overlapped", True)] * 6
    return {"v c=2 burst 0": [(2, None, 2.0, None, "fresh", False)] + plain + k1,
            "v c=2 burst 1": k7 + plain}


def test_replay_groups_steps_and_reads_the_model_as_the_engine_did():
    runs = replay(_trace(), match="burst", every=1)
    assert [r["run"] for r in runs] == ["v c=2 burst 0", "v c=2 burst 1"]
    first = runs[0]["by_drafts"]
    assert first["0"]["steps"] == 6 and first["0"]["median_ms"] == 0.5
    assert first["0"]["tokens_per_ms"] == 4.0 and first["1"]["tokens_per_ms"] == 4.0
    assert first["untimed"]["steps"] == 1 and first["untimed"]["tokens_per_ms"] is None
    last = runs[0]["readings"][-1]
    # K=1 steps of 0.75 ms against 0.5 plain: one level, priced per draft alone
    assert last["plain_ms"] == 0.5 and last["per_draft"] == 0.5 and last["fixed"] == 0.0
    assert last["gain"] == (3 / 2 / 0.75) / (2 / 2 / 0.5)
    # the second run's K=7 level (1.0 ms: 1 over plain at 7 drafts; K=1's 0.5 at 1) splits
    # a fixed part from the price of a draft: the line through both levels
    mid = runs[1]["readings"][5]
    assert mid["fixed"] == round(0.5 - 0.5 / 6, 3) and mid["per_draft"] == round(0.5 / 6, 3)
    assert replay(_trace(), match="burst 1", every=100)[0]["run"] == "v c=2 burst 1"
    walled = replay(_trace(), match="burst 0", walls={"v c=2 burst 0": 10.0})[0]
    assert walled["wall_ms"] == 10.0 and walled["outside_steps_ms"] == 10.0 - 2.0 - 3.0 - 4.5


def test_cli_writes_json(tmp_path, capsys):
    src, out = tmp_path / "t.json", tmp_path / "o.json"
    src.write_text(json.dumps(_trace()))
    fig3 = tmp_path / "f.json"
    fig3.write_text(json.dumps({"trace_burst_wall_ms": {"v c=2 burst 0": 12.0}}))
    assert main([str(src), "--match", "burst 0", "--json", str(out), "--fig3", str(fig3)]) == 0
    assert "v c=2 burst 0: 13 steps, wall 12.0 ms, 2.5 ms outside the steps" in \
        capsys.readouterr().out
    assert json.loads(out.read_text())[0]["by_drafts"]["1"]["steps"] == 6


def test_switches_of_k_replay_as_the_engine_marks_them_or_by_pure_levels():
    """Steps the trace marks as switches of K (`how` ending in "switch"), or with `pure`
    those at other levels, are no points of the fit: a dear 1.5-draft step between K=1 and
    K=7 steps leaves the line through those two levels as it was."""
    plain = [(1, 0.0, 0.5, 1, "overlapped", True)] * 6
    k1 = [(1, 1.0, 0.6, 2, "overlapped", True)] * 4
    k7 = [(1, 7.0, 1.2, 5, "overlapped", True)] * 4
    dear = [(1, 1.5, 1.5, 2, "overlapped", True)] * 8
    marked = [(1, 1.5, 1.5, 2, "overlapped switch", True)] * 8
    clean = replay({"r": plain + k1 + k7}, every=1)[0]["readings"][-1]
    assert clean["per_draft"] > 0.1
    for trace, pure in (({"r": plain + k1 + k7 + marked}, None),
                        ({"r": plain + k1 + k7 + dear}, {1.0, 7.0})):
        last = replay(trace, every=1, pure=pure)[0]["readings"][-1]
        assert (last["fixed"], last["per_draft"]) == (clean["fixed"], clean["per_draft"])
    last = replay({"r": plain + k1 + k7 + dear}, every=1)[0]["readings"][-1]
    assert last["per_draft"] != clean["per_draft"]


def test_levels_table_pools_matching_runs_by_full_batch_and_tail(capsys):
    from bench.trace_replay import levels_table

    trace = _trace()
    trace["v c=2 burst 1"] = trace["v c=2 burst 1"] + [(1, 1.0, 0.6, 2, "overlapped", True)]
    trace["v c=2 steady 0"] = [(2, 7.0, 9.0, 1, "overlapped", True)]  # not matched
    got = levels_table(trace, "burst")
    assert got["full"]["0"] == {"steps": 12, "mean_ms": 0.5, "tokens_per_step": 2.0,
                                "tokens_per_ms": 4.0}
    assert got["full"]["7"]["steps"] == 6 and got["full"]["7"]["tokens_per_ms"] == 8.0
    assert got["tail"] == {"1": {"steps": 1, "mean_ms": 0.6, "tokens_per_step": 2.0,
                                 "tokens_per_ms": 3.33}}
    assert "untimed" not in got["full"]
