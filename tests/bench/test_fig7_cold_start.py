"""Figure 7 end to end at tiny size on the CPU (`--fig7-smoke`: a tiny random model with
SmolLM2's tokenizer, a random EAGLE-3 head): every fresh process lands in the JSON with its
times, passes and compile counts, and the goals are computed from those rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench.common import ratio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("no_spec", "eagle3_default")


@pytest.fixture(scope="module")
def fig7(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fig7")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.suite", "--device", "cpu", "--figures",
                           "7", "--fig7-smoke", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    res = json.loads((out / "fig7_cold_start.json").read_text())
    assert proc.returncode == 0 and "error" not in res, (proc.stdout + proc.stderr)[-3000:]
    return res


def test_each_variant_and_concurrency_ran_in_a_fresh_process_of_its_own(fig7):
    conc, n = fig7["config"]["concurrency"], fig7["config"]["max_tokens"]
    assert conc == [1] and fig7["triton_cache"]["mode"] == "cold"
    dirs = set()
    for v in VARIANTS:
        rows = sorted(fig7["runs"][v], key=lambda r: r["concurrency"])
        assert [r["concurrency"] for r in rows] == conc
        for r in rows + [fig7["ready"][v]]:
            assert 0 < r["python_started_s"] < r["imported_s"] < r["built_s"] <= r["ready_s"]
            assert r["ready_s"] < r["process_s"]
            # Read through the engine's metric and jit_watch alike; none on a CPU.
            assert r["compiles_after_ready"] == r["compiles_after_ready_metric"] == 0
            dirs.add(r["triton_cache_dir"])
        for r in rows:
            for p in ("first_pass", "second_pass"):
                assert r[p]["tokens"] == r["concurrency"] * n and r[p]["tokens_per_s"] > 0
                # No engine warms off CUDA: the speculative one has nothing pending.
                assert r[p]["spec_graphs_pending"] == (None if v == "no_spec" else 0)
            assert r["first_over_second_wall"] == ratio(r["first_pass"]["wall_s"],
                                                        r["second_pass"]["wall_s"])
            assert r["first_pass"]["served_wall_s"] == pytest.approx(
                r["first_pass"]["wall_s"] - r["prepare_s"], abs=2e-3)
        ready = fig7["ready"][v]
        assert ready["ready"]["load_s"] > 0 and ready["first_request"]["tokens"] == n
        assert len(ready["steady_reps_s"]) == fig7["config"]["ready_reps"]
    assert len(dirs) == 4 and not any(map(os.path.exists, dirs))  # fresh, removed after
    assert fig7["config"]["engine_default_spec"]["method"] == "eagle3"


def test_the_goals_are_computed_from_the_rows(fig7):
    tps = {v: {r["concurrency"]: r["first_pass"]["tokens_per_s"] for r in fig7["runs"][v]}
           for v in VARIANTS}
    want = {str(c): ratio(tps["eagle3_default"][c], tps["no_spec"][c]) for c in (1,)}
    goals = fig7["goals"]
    assert goals["eagle3_first_pass_vs_no_spec"] == want == fig7["first_pass_vs_no_spec"]
    low = min(want.values())
    assert goals["eagle3_first_pass_min_ratio"] == low
    assert goals["eagle3_first_pass_at_least_0.97x_no_spec"] is (low >= 0.97)
    assert goals["compiles_after_ready"] == 0 and goals["no_compiles_after_ready"] is True
    firsts = {v: ratio(fig7["ready"][v]["first_request_s"], fig7["ready"][v]["steady_request_s"])
              for v in VARIANTS}
    assert goals["first_request_after_ready_vs_steady"] == firsts
    assert goals["first_request_within_1.2x_steady"] is (max(firsts.values()) <= 1.2)
    assert goals["children_skipped"] == goals["children_failed"] == []
    assert fig7["time_to_ready_s"]["no_spec"]["prepare_to_serve"] == \
        fig7["ready"]["no_spec"]["ready_s"]


def rows(first: dict, late: int = 0, firsts=(1.1, 1.0)) -> dict:
    """A figure 7 result of made-up rows: first-pass tokens/s per (variant, concurrency)."""
    run = lambda v, c, x: {"concurrency": c, "compiles_after_ready": late, "ready_s": 1.0,
                           "first_pass": {"tokens_per_s": x}, "second_pass": {}}
    return {"runs": {v: [run(v, c, x) for (w, c), x in first.items() if w == v]
                     for v in VARIANTS},
            "ready": {v: {"compiles_after_ready": 0, "first_over_steady": f, "ready_s": 1.0}
                      for v, f in zip(VARIANTS, firsts)},
            "skipped_children": [], "failed_children": []}


def test_goals_fail_on_a_slow_first_pass_or_a_late_compile_and_stay_open_when_unmeasured():
    from bench.fig7_cold_start import fig7_goals, summarize

    res = rows({("no_spec", 1): 100.0, ("eagle3_default", 1): 98.0,
                ("no_spec", 8): 400.0, ("eagle3_default", 8): 380.0})
    summarize(res, [1, 8])
    g = fig7_goals(res, [1, 8])
    assert g["eagle3_first_pass_min_ratio"] == 0.95
    assert g["eagle3_first_pass_at_least_0.97x_no_spec"] is False
    assert g["no_compiles_after_ready"] is True and g["first_request_within_1.2x_steady"] is True

    res = rows({("no_spec", 1): 100.0, ("eagle3_default", 1): 99.0, ("no_spec", 8): 400.0},
               late=2, firsts=(1.3, None))
    res["skipped_children"] = ["cold eagle3_default c=8"]
    summarize(res, [1, 8])
    g = fig7_goals(res, [1, 8])
    assert g["eagle3_first_pass_vs_no_spec"] == {"1": 0.99, "8": None}
    assert g["eagle3_first_pass_at_least_0.97x_no_spec"] is None  # c=8 not measured
    assert g["compiles_after_ready"] == 6 and g["no_compiles_after_ready"] is False
    assert g["first_request_within_1.2x_steady"] is False


def test_processes_past_the_deadline_are_skipped_and_listed(tmp_path):
    from bench.fig7_cold_start import TritonCache, run_jobs

    args = SimpleNamespace(fig7_deadline_s=0.0, out=str(tmp_path))
    res = {"figure": 7, "name": "cold_start"}
    run_jobs(args, res, TritonCache("cold"), [("ready", "no_spec", 1), ("cold", "no_spec", 8)])
    assert res["skipped_children"] == ["ready no_spec", "cold no_spec c=8"]
    assert res["ready"] == {} and res["runs"] == {v: [] for v in VARIANTS}


def test_the_triton_cache_is_a_fresh_folder_per_process_or_the_shared_one(monkeypatch, tmp_path):
    from bench.fig7_cold_start import TritonCache

    cold = TritonCache("cold")
    a, b = cold.open(), cold.open()
    assert a != b and os.listdir(a) == []
    cold.close(a)
    cold.close(b)
    assert not os.path.exists(a) and not os.path.exists(b)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    (tmp_path / "kernel.cubin").write_bytes(b"")
    warm = TritonCache("warm")
    assert warm.open() == str(tmp_path) and warm.record()["files_before"] == 1
    warm.close(str(tmp_path))
    assert tmp_path.exists()
