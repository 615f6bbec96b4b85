"""The UCX sweep's pure pieces: configuration parsing and selection, the phase breakdown of
a transfer's timeline, scoring and merging the winners, the summary against peer copy."""

from __future__ import annotations

import pytest

from bench.ucx_sweep import (
    Config,
    combine,
    config_from_settings,
    gpu_plan,
    parse_config,
    phase_summary,
    proto_lines,
    pull_phases,
    score,
    select,
    summarize,
    trace_path,
)

MIB = 1 << 20


def test_parse_config_splits_env_and_progress():
    cfg = parse_config("mine: UCX_RNDV_SCHEME=put_zcopy , progress=thread-polling,UCX_A=x=y")
    assert cfg.name == "mine"
    assert cfg.env == {"UCX_RNDV_SCHEME": "put_zcopy", "UCX_A": "x=y"}
    assert cfg.progress == "thread-polling"
    assert cfg.settings() == {"UCX_RNDV_SCHEME": "put_zcopy", "UCX_A": "x=y",
                              "progress": "thread-polling"}
    assert parse_config("bare:").env == {}
    for bad in ("noname", ":UCX_A=1", "x:UCX_A", "x:progress=fast"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_plan_names_are_unique_and_selection_keeps_the_baseline():
    names = [c.name for c in gpu_plan()]
    assert len(names) == len(set(names)) and names[0] == "baseline"
    assert [c.name for c in select(gpu_plan(), ["rndv_put"])] == ["baseline", "rndv_put"]
    with pytest.raises(ValueError, match="nope"):
        select(gpu_plan(), ["nope"])


def trace(ready, landed, header=0.5, synced=None, ack=None, acked=None, sent=None):
    synced = landed[-1] + 0.2 if synced is None else synced
    ack = synced + 0.1 if ack is None else ack
    return {"chunks": len(ready), "ready": ready, "sent": sent or landed[-1],
            "acked": acked or ack + 0.3,
            "rx": {"header": header, "landed": landed, "scattered": synced - 0.1,
                   "synced": synced, "ack": ack}}


def test_trace_path_telescopes_to_the_total():
    t = trace([1.0, 2.0, 3.0], [2.5, 3.5, 4.0])
    p = trace_path(t)
    parts = ("gather", "first_chunk", "rest_chunks", "scatter", "rx_tail", "ack")
    assert sum(p[k] for k in parts) == pytest.approx(p["total"]) == pytest.approx(4.6)
    assert p["gather"] == 1.0 and p["first_chunk"] == 1.5 and p["rest_chunks"] == 1.5
    assert p["wire_last"] == pytest.approx(1.0) and p["header_in"] == 0.5
    assert trace_path({**t, "rx": None}) is None  # a receiver that sent no stamps


def test_phase_summary_is_the_median_in_ms():
    ts = [trace([0.001], [0.002 + d]) for d in (0.0, 0.004, 0.001)]
    s = phase_summary(ts)
    assert s["first_chunk"] == pytest.approx(2.0)  # medians: 1 ms + 1 ms
    assert s["gather"] == pytest.approx(1.0)
    assert phase_summary([]) is None


def rows(gb_by_size_chunks):
    return [{"bytes": b, "chunks": c, "median_gb_s": g, "median_ms": b / g / 1e6}
            for (b, c), g in gb_by_size_chunks.items()]


DEFAULT = rows({(16 * MIB, 1): 10.0, (16 * MIB, 8): 5.0, (1024 * MIB, 8): 200.0})


def result(name, table, settings, status="ok"):
    return {"name": name, "status": status, "rows": rows(table), "settings": settings}


def test_score_is_the_geometric_mean_of_best_per_size():
    mine = rows({(16 * MIB, 1): 40.0, (1024 * MIB, 1): 100.0, (1024 * MIB, 16): 200.0})
    assert score(mine, DEFAULT) == pytest.approx(2.0)  # sqrt(4 * 1)
    assert score(rows({(64 * MIB, 1): 1.0}), DEFAULT) is None  # nothing in common


def test_combine_merges_winners_best_first_without_overriding():
    results = [
        {"name": "default", "status": "ok", "rows": DEFAULT, "settings": {"UCX_PROTO_INFO": "y"}},
        result("put", {(16 * MIB, 1): 20.0, (1024 * MIB, 8): 300.0},
               {"UCX_RNDV_SCHEME": "put_zcopy"}),
        result("get", {(16 * MIB, 1): 11.0, (1024 * MIB, 8): 210.0},
               {"UCX_RNDV_SCHEME": "get_zcopy"}),
        result("polling", {(16 * MIB, 1): 15.0, (1024 * MIB, 8): 200.0},
               {"progress": "thread-polling"}),
        result("worse", {(16 * MIB, 1): 5.0, (1024 * MIB, 8): 100.0}, {"UCX_X": "1"}),
        result("crashed", {(16 * MIB, 1): 99.0, (1024 * MIB, 8): 999.0}, {"UCX_Y": "1"},
               status="timeout"),
    ]
    merged, used = combine(results)
    assert used == ["put", "polling"]  # "get" beat the default too, but "put" set its key
    assert merged == {"UCX_RNDV_SCHEME": "put_zcopy", "progress": "thread-polling"}
    cfg = config_from_settings("combined", merged, "test")
    assert cfg.progress == "thread-polling" and cfg.env == {"UCX_RNDV_SCHEME": "put_zcopy"}
    assert combine([r for r in results if r["name"] != "default"]) == ({}, [])


def test_summarize_picks_best_per_size_and_judges_the_goal():
    results = [
        {"name": "default", "status": "ok", "rows": DEFAULT},
        {"name": "put", "status": "ok",
         "rows": rows({(16 * MIB, 1): 20.0, (1024 * MIB, 16): 320.0})},
        {"name": "dead", "status": "timeout", "rows": []},
    ]
    baseline = {"peer_copy": [{"bytes": 16 * MIB, "gb_s": 250.0},
                              {"bytes": 1024 * MIB, "gb_s": 400.0}]}
    s = summarize(results, baseline)
    top = s["best"][str(1024 * MIB)]
    assert top == {"config": "put", "chunks": 16, "gb_s": 320.0, "vs_peer": 0.8}
    assert s["goal"]["met"] and s["goal"]["bytes"] == 1024 * MIB
    assert s["by_config"]["default"]["best"][str(16 * MIB)]["chunks"] == 1
    assert s["by_config"]["put"]["score_vs_default"] == pytest.approx(
        ((20 / 10) * (320 / 200)) ** 0.5, abs=1e-3)
    assert "dead" not in s["by_config"]
    assert not summarize(results[:1], baseline)["goal"]["met"]  # 200 / 400 = 0.5
    assert "pull" not in s["by_config"]["default"]  # no pull rows measured


def test_summarize_reports_pull_rows_apart():
    """IPC rows (`kvtransfer.ipc`: push and pull) stand beside the UCX-message rows, each
    path apart, per size against the peer copy, and never enter the message paths' best or
    score; a row that fell back to messages is neither."""
    pull = [{"bytes": 1024 * MIB, "path": "pull", "median_gb_s": 340.0, "median_ms": 3.158,
             "phases_ms": {"header_in": 0.4, "rx_ack": 0.45, "total": 3.158}},
            {"bytes": 1024 * MIB, "path": "push", "median_gb_s": 380.0, "median_ms": 2.826},
            {"bytes": 16 * MIB, "path": "staged", "median_gb_s": 9.0, "median_ms": 1.9}]
    results = [{"name": "default", "status": "ok", "rows": DEFAULT, "pull": pull}]
    baseline = {"peer_copy": [{"bytes": 1024 * MIB, "gb_s": 400.0}]}
    s = summarize(results, baseline)
    got = s["by_config"]["default"]["pull"]
    assert list(got) == [str(1024 * MIB)]
    assert got[str(1024 * MIB)]["vs_peer"] == 0.85
    assert s["by_config"]["default"]["push"][str(1024 * MIB)]["vs_peer"] == 0.95
    assert s["best"][str(1024 * MIB)]["gb_s"] == 200.0  # the message paths' best only


def test_pull_phases_are_medians_in_ms():
    traces = [{"acked": 0.0031 + i * 1e-4, "rx": {"header": 0.0004, "ack": 0.0005}}
              for i in range(3)] + [{"acked": 1.0, "rx": None}]
    assert pull_phases(traces) == {"header_in": 0.4, "rx_ack": 0.5, "total": 3.2}
    assert pull_phases([]) is None


def test_proto_lines_keeps_gpu_tables_first_once():
    log = "\n".join([
        "noise",
        "[1.0] [h:1:0]   | ucp_context_0 intra-node cfg#0 | tagged message from host memory |",
        "[1.0] [h:1:0]   |   0..92 | eager short | sysv/memory |",
        "[1.1] [h:2:0]   | ucp_context_0 intra-node cfg#1 | tagged message from cuda/GPU0 |",
        "[1.1] [h:2:0]   |  0..inf | rendezvous zero-copy read from remote | cuda_ipc/cuda |",
        "[1.2] [h:3:0]   | ucp_context_0 intra-node cfg#0 | tagged message from host memory |",
        "[1.2] [h:3:0]   |   0..92 | eager short | sysv/memory |",
    ])
    got = proto_lines(log)
    assert len(got) == 4 and "cuda/GPU0" in got[0] and "cuda_ipc" in got[1]
    assert got[2].startswith("| ucp_context_0") and "[" not in got[2][:3]
    assert Config("x").settings() == {}
