"""Figure 5's disaggregated half at tiny size on the CPU: the prefill engine in its own
process, KV shipped over UCX into blocks the decode engine reserved, the decode loop measured.
Mechanics only (the numbers mean nothing here)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_UCX = importlib.util.find_spec("ucxx") is not None


@pytest.fixture(scope="module")
def fig5(tmp_path_factory) -> dict:
    """One smoke run of figure 5 in its own interpreter (ucxx binds one event loop per
    process; this keeps it away from the other tests' loop)."""
    out = tmp_path_factory.mktemp("fig5")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.suite", "--device", "cpu", "--figures", "5",
         "--fig5-smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    log = proc.stdout + proc.stderr
    path = out / "fig5_itl_disagg.json"
    assert path.exists(), log
    res = json.loads(path.read_text())
    assert proc.returncode == 0 and "error" not in res, res.get("error") or log[-4000:]
    return res


def rows(res: dict) -> dict[str, dict]:
    return {k: res[k] for k in ("colocated", "disaggregated", "disaggregated_in_process")
            if k in res}


def test_the_disaggregated_half_ran_in_two_processes_over_ucx(fig5):
    main = fig5["disaggregated"]
    if HAVE_UCX:
        assert main["path"] == "processes+ucx"
        assert fig5["config"]["disaggregated_path"] == "processes+ucx"
        pp = fig5["prefill_process"]
        assert pp["pid"] != os.getpid() and pp["exit_code"] == 0
        assert pp["weights_identical_to_decode"] is True
        assert pp["bye"]["held_left"] == 0  # every lease ended with the receiver's ack
        assert fig5["disaggregated_in_process"]["path"] == "in-process"
    else:  # the labelled fallback
        assert main["path"].startswith("in-process (fallback: ucxx not importable")


def test_every_stream_produced_tokens_and_gaps_were_recorded(fig5):
    cfg = fig5["config"]
    for name, row in rows(fig5).items():
        assert row["complete"], name
        per_stream = row["background_tokens_per_stream"]
        assert len(per_stream) == cfg["background_streams"]
        assert all(n >= 8 for n in per_stream.values()), (name, per_stream)
        assert row["itl_while_prompts_arrive"]["count"] > 0, name
        assert row["itl_before_arrivals"]["count"] > 0, name
        assert row["itl_while_prompts_arrive"]["p99_ms"] > 0, name
        assert len(row["long_ttft_ms"]["all"]) == cfg["long_prompts"], name


def test_disaggregated_outputs_equal_colocated_token_for_token(fig5):
    cfg = fig5["config"]
    for name in ("disaggregated", "disaggregated_in_process"):
        if name not in fig5:
            continue
        row = fig5[name]
        n = cfg["long_prompts"]
        assert row["long_outputs_identical_to_colocated"] == f"{n}/{n}", name
        assert row["long_tokens_per_request"] == {
            f"long{i}": cfg["long_max_tokens"] for i in range(n)}, name


def test_every_prompt_s_kv_was_shipped_and_accounted(fig5):
    cfg = fig5["config"]
    for name in ("disaggregated", "disaggregated_in_process"):
        if name not in fig5:
            continue
        kv = fig5[name]["kv_transfers"]
        assert kv["count"] == cfg["long_prompts"], name
        blocks = -(-cfg["long_prompt_tokens"] // 16)
        for r in fig5[name]["kv_transfer_rows"]:
            assert r["blocks"] == blocks and r["bytes"] > 0 and r["seconds"] > 0, (name, r)
            assert r["kv_identical"] is True, (name, r)  # the decode side got the right KV
        assert kv["kv_identical"] == f"{kv['count']}/{kv['count']}", name
        assert kv["bytes_total"] == sum(r["bytes"] for r in fig5[name]["kv_transfer_rows"])
    if HAVE_UCX:
        rows_ = fig5["disaggregated"]["kv_transfer_rows"]
        assert all(r["first_token_to_admit_ms"] >= r["seconds"] * 1e3 for r in rows_)
        assert fig5["prefill_process"]["bye"]["bytes_shipped"] == \
            fig5["disaggregated"]["kv_transfers"]["bytes_total"]


def test_a_failing_prefill_process_raises_and_leaves_no_child():
    """The child's traceback reaches the parent, and close() leaves no process behind."""
    from bench import suite
    from bench.fig5_process import FIG5_SMOKE, PrefillProcess

    p = argparse.ArgumentParser()
    suite.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--dtype", "float32", "--fig5-smoke"])
    args = argparse.Namespace(**{**vars(args), **FIG5_SMOKE})
    pp = PrefillProcess(args, "cpu")
    try:
        pp.send(("go", {"kind": "not-a-transport"}))  # its connect() must fail
        with pytest.raises(RuntimeError, match="prefill process failed") as err:
            pp.expect("ready", 60)
        assert "not a UCX transport address" in str(err.value) or not HAVE_UCX
    finally:
        code = pp.close(timeout=10)
    assert not pp.proc.is_alive()
    assert code not in (None, 0)
