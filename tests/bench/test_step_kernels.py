"""bench.step_kernels' accounting of a forward's kernels (no GPU: synthetic timelines)."""

from bench.step_kernels import summarize


def test_marginal_times_add_up_to_the_span_and_overlap_is_not_counted_twice():
    # One forward: a (0-10), b starts early under PDL and ends at 14, a again 14-20, c 25-27.
    fwd = [("a", 0.0, 10.0), ("b", 2.0, 14.0), ("a", 14.0, 20.0), ("c", 25.0, 27.0)]
    later = [(n, s + 1000.0, e + 1000.0) for n, s, e in fwd]
    res = summarize([[("warm-up", 0.0, 1.0)], fwd, later])  # the first call is left out
    assert res["forwards"] == 2
    assert res["span_us"] == 27.0
    assert res["kernel_time_sum_us"] == 10 + 12 + 6 + 2
    k = res["kernels"]
    assert k["a"] == {"launches": 2, "marginal_us": 16.0, "marginal_us_per_launch": 8.0}
    assert k["b"]["marginal_us"] == 4.0 and k["c"]["marginal_us"] == 7.0
    assert sum(v["marginal_us"] for v in k.values()) == res["span_us"]
    assert list(k) == ["a", "c", "b"]  # by marginal time
