"""bench/loop_copies.py's summary of dynamic K's steps (the GPU run itself is not in CI)."""

from __future__ import annotations

from bench.loop_copies import trace_summary


def test_trace_summary_groups_steps_by_draft_count():
    trace = [(1, 0.0, 0.5, 1, "overlapped", True), (1, 0.0, 0.7, 1, "overlapped", True),
             (1, 0.0, 0.6, 1, "fresh", False), (1, 7.0, 1.1, 8, "overlapped", True),
             (1, 7.0, 1.3, 2, "overlapped", True), (1, None, 3.0, None, "prefill", False)]
    got = trace_summary(trace)
    assert list(got) == ["other", "0.0", "7.0"]
    assert got["0.0"] == {"steps": 3, "median_ms": 0.6, "mean_tokens": 1.0}
    assert got["7.0"] == {"steps": 2, "median_ms": 1.2, "mean_tokens": 5.0}
    assert got["other"] == {"steps": 1, "median_ms": 3.0, "mean_tokens": 0.0}
