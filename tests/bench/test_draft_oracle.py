"""bench.draft_oracle's replay and pricing on hand-made answers (no model)."""

from __future__ import annotations

import itertools
import random

from bench.draft_oracle import lead, timing, walk


def test_lead_and_walk_follow_the_answer():
    answer = [1, 2, 3, 4, 5, 6, 7]
    assert lead([3, 4, 9], answer, 2) == 2 and lead([9], answer, 2) == 0
    assert lead([7, 8], answer, 6) == 1  # nothing past the answer's end counts
    # Every step accepts two drafts: steps of 3 tokens, the last one cut at the end.
    assert walk(answer, 1, lambda n: 2) == [3, 3]
    assert walk(answer, 0, lambda n: 0) == [1] * 7


def _brute(end, start, acc, price, kmax):
    """Least time over every K sequence (short answers only)."""
    best = float("inf")
    for ks in itertools.product(range(kmax + 1), repeat=end - start + 1):
        n, t, i = start, 0.0, 0
        while n < end:
            t += price(ks[i], ks[i + 1])
            n += 1 + min(ks[i], acc[n])
            i += 1
        best = min(best, t)
    return best


def test_foresight_bound_is_the_best_k_sequence_and_fixed_k_is_priced_by_level():
    rng = random.Random(0)
    cost = {(q, d): 1.0 + 0.15 * q + 0.05 * d + rng.random() * 0.05
            for q in (1, 2, 4) for d in (0, 1, 3)}
    qs, ds = (1, 2, 4), (0, 1, 3)

    def price(k, k2):
        return cost[(next(x for x in qs if x > k), next(x for x in ds if x >= k2))]

    for seed in range(4):
        r = random.Random(seed)
        end, start = 8, 1
        acc = {n: r.choice([0, 0, 1, 2, 3]) for n in range(start, end)}
        got = timing([(end, start, acc)], (1.0, cost), 3)
        tokens = end - start
        assert abs(got["foresight_bound"] - round(tokens / _brute(end, start, acc, price, 3),
                                                   3)) < 1e-9
        assert got["foresight_bound"] >= max(max(got["fixed_k"].values()), got["geometric_rule"])
    # Fixed K=0 pays the (q=1, d=0) step per token.
    assert got["fixed_k"][0] == round(1.0 / cost[(1, 0)], 3)


def test_main_on_the_embedded_model(tmp_path):
    """The whole replay on the embedded SmolLM2 and the shipped head, two short answers."""
    from bench.draft_oracle import main

    res = main(["--k", "3", "--tokens", "24", "--fig1-prompts", "1", "--other-prompts", "1",
                "--min-n", "3", "--confidence", "0.9", "--device", "cpu",
                "--out", str(tmp_path / "o.json")])
    assert (tmp_path / "o.json").exists()
    for name in ("fig1", "other"):
        s = res["sets"][name]
        rules = s["k"][3]
        assert set(rules) == {"head", "context_min3", "both_min3", "confident0.9_min3"}
        for r in rules.values():
            assert 1.0 <= r["acceptance_length"] <= 4.0 and r["steps"] >= 24 / 4 - 1
        priced = s["priced"]["measured"]
        assert priced["foresight_bound"] >= max(priced["fixed_k"].values()) > 0.5
    assert res["sets"]["fig1"]["answer_tokens"] == [24]  # EOS ignored there
