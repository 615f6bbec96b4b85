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


def test_every_level_interpolates_between_the_measured_graphs():
    """Prices at levels the table lacks lie on the lines between measured ones; measured
    levels keep their price; a linear table comes back whole."""
    from bench.draft_oracle import every_level

    def lin(q, d):
        return 600.0 + 45.0 * q + 30.0 * d

    grid = {(q, d): lin(q, d) for q in (1, 2, 4, 8) for d in (0, 1, 2, 4, 7)}
    full = every_level(grid)
    assert set(full) == {(q, d) for q in range(1, 9) for d in range(8)}
    assert all(abs(full[k] - lin(*k)) < 1e-9 for k in full)
    bent = {**grid, (8, 7): grid[(8, 7)] + 80.0}
    got = every_level(bent)
    assert got[(8, 7)] == bent[(8, 7)] and got[(4, 4)] == bent[(4, 4)]
    # (6, 5): halfway from q=4 to q=8, and 1/3 of the way from d=4 to d=7 at each
    at8 = bent[(8, 4)] + (bent[(8, 7)] - bent[(8, 4)]) / 3
    at4 = bent[(4, 4)] + (bent[(4, 7)] - bent[(4, 4)]) / 3
    assert abs(got[(6, 5)] - (at4 + at8) / 2) < 1e-9
    # a fixed K=5 step now costs less than a K=7 step
    r = timing([(20, 1, {n: 5 for n in range(1, 20)})], (600.0, got), 7)
    assert r["fixed_k"][5] > timing([(20, 1, {n: 5 for n in range(1, 20)})],
                                    (600.0, bent), 7)["fixed_k"][5]


def test_the_cut_verifies_while_the_heads_probability_holds_and_prices_dead_rows():
    """`cut_accepts`: the head's chain is verified while the product of its drafts'
    probabilities stays at least the cut, a context copy never cut; `cut_timing`: no cut
    is fixed K's price, a cut step pays the live rows' price plus dead_us a dead row."""
    from bench.draft_oracle import cut_accepts, cut_timing, every_level

    answer = list(range(20))
    chains = {n - 2: [n, n + 1, 99, n + 3] for n in range(1, 20)}  # two right, then wrong
    probs = {n - 2: [0.9, 0.5, 0.5, 0.9] for n in range(1, 20)}
    ctx = {n: (0, []) for n in range(2, 20)}
    ctx[5] = (3, [5, 6, 7, 8])  # a copy, right throughout
    got = cut_accepts(answer, chains, probs, ctx, 4, 3, 0.4)  # 0.9, 0.45 pass; 0.225 not
    assert got[2] == (2, 2) and got[5] == (4, 4)
    assert cut_accepts(answer, chains, probs, ctx, 4, 3, 0.0)[2] == (2, 4)
    assert cut_accepts(answer, chains, probs, ctx, 4, 3, 0.95)[2] == (0, 0)

    def lin(q, d):
        return 600.0 + 45.0 * q + 30.0 * d

    cost = {(q, d): lin(q, d) for q in (1, 2, 4, 8) for d in (0, 1, 2, 4, 7)}
    full = every_level(cost)
    every = [(10, 1, {n: (7, 7) for n in range(1, 10)})]
    assert cut_timing(every, (600.0, cost), 7, 5.0)["speed"] == \
        timing([(10, 1, {n: 7 for n in range(1, 10)})], (600.0, cost), 7)["fixed_k"][7]
    two = [(4, 1, {1: (1, 2), 3: (0, 0)})]  # verified 2 (accepted 1), then none
    t = full[(3, 7)] + 5 * 5.0 + full[(1, 7)] + 7 * 5.0
    r = cut_timing(two, (600.0, cost), 7, 5.0)
    assert r["speed"] == round(3 * 600.0 / t, 3) and r["verified"] == 1.0
    assert r["acceptance"] == 1.5


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
        cut = s["priced"]["cut"]
        assert cut["k"] == 3 and {"0.0", "0.01", "0.05"} <= set(cut)
        # a stricter cut verifies no more drafts
        assert cut["0.0"]["verified"] >= cut["0.01"]["verified"] >= cut["0.05"]["verified"]
    assert res["sets"]["fig1"]["answer_tokens"] == [24]  # EOS ignored there


def test_the_live_policy_follows_the_answers_acceptance():
    """`live_rule` drives the engine's own dynamic K (`KPolicy.choose_batch`, its probes and
    measured overrides, fed each step's exact price) over the replayed answers: where every
    draft lands it drafts the deepest K nearly always and runs near fixed K's speed; where
    none does it settles at K=0 and runs near plain decoding, probes and retries aside."""
    from bench.draft_oracle import live_rule, step_prices

    plain, cost = step_prices("bench/results/profile/fused_costs_bd70aca/fused_costs.json")
    qs, ds = sorted({q for q, _ in cost}), sorted({d for _, d in cost})

    def price(k, k2):
        return cost[(next(x for x in qs if x > k), next(x for x in ds if x >= k2))]

    end = 600
    good = [(end, 1, {n: 7 for n in range(1, end)})]
    got = timing(good, (plain, cost), 7)
    assert got["live_rule"] > 0.93 * got["fixed_k"][7] and got["fixed_k"][7] > 2.5
    _, picks = live_rule(good, price, (tuple(qs), tuple(ds)), 7, plain)
    deep = sum(v for k, v in picks.items() if k.startswith("7:"))
    assert deep > 0.8 * sum(picks.values())
    bad = [(end, 1, {n: 0 for n in range(1, end)})]
    got = timing(bad, (plain, cost), 7)
    assert 0.85 < got["live_rule"] <= got["fixed_k"][0] + 1e-9
    _, picks = live_rule(bad, price, (tuple(qs), tuple(ds)), 7, plain)
    assert sum(v for k, v in picks.items() if k.startswith("0:")) > 0.7 * sum(picks.values())


def test_live_variants_replay_the_policy_under_fields_and_module_constants():
    """`timing(variants=)`: the engine's dynamic K replayed under SpecConfig fields and module
    constants (set for the replay only): a variant changing nothing reads the live rule's
    speed; `batch_k=7` drafts K=7 wherever it is not probing, retrying or measured losing;
    a bad variant is refused before any model loads."""
    import pytest

    from bench.draft_oracle import main, timing
    from bench.spec_ab import parse_variant
    from engine.spec import policy

    def lin(q, d):
        return 600.0 + 45.0 * q + 30.0 * d

    cost = {(q, d): lin(q, d) for q in (1, 2, 4, 8) for d in (0, 1, 2, 4, 7)}
    answers = [(300, 1, {n: (7 if (n // 40) % 2 else 1) for n in range(1, 300)})]
    names = ["same:", "k7:batch_k=7", "m:engine.spec.policy.MARGIN=3.0"]
    variants = {n: (f, s) for n, f, s in map(parse_variant, names)}
    margin = policy.MARGIN
    r = timing(answers, (600.0, cost), 7, variants)
    assert policy.MARGIN == margin  # put back
    lv = r["live_variants"]
    assert lv["same"]["speed"] == r["live_rule"] and lv["same"]["picks"] == r["live_picks"]
    assert {p.split(":")[1] for p in lv["k7"]["picks"]} <= {"fixed", "probe", "retry",
                                                            "losing"}
    assert lv["k7"]["picks"].get("7:fixed", 0) > 0
    assert lv["m"]["picks"] != r["live_picks"]  # deeper K must win 3x: fewer deep picks
    with pytest.raises(SystemExit):
        main(["--live-variant", "x:no_such_field=1"])
