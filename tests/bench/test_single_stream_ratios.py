"""Figure 1's ratios and token identity (bench/fig1_single_stream.py `single_stream_ratios`): HF's
baselines generate the first --fig1-hf-prompts prompts only, so their identity counts
the streams both made."""


def test_hf_baselines_on_fewer_prompts_count_only_the_streams_both_made():
    from bench.fig1_single_stream import single_stream_ratios

    res = {"tandem": {"no_spec": {"tokens_per_s": 100.0}, "eagle3_k7": {"tokens_per_s": 250.0}},
           "hf": {"eager": {"tokens_per_s": 20.0}, "compiled": {"tokens_per_s": 50.0}}}
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    outs = {"no_spec": ref, "eagle3_k7": [[1, 2, 3], [4, 5, 0], [7, 8, 9], [1, 1, 1]],
            "hf_eager": ref[:1], "hf_compiled": [[1, 2, 0]]}
    single_stream_ratios(res, outs)
    k7, eager, compiled = res["tandem"]["eagle3_k7"], res["hf"]["eager"], res["hf"]["compiled"]
    assert (k7["streams"], k7["token_identical_to_no_spec"]) == (4, 3)
    assert k7["first_divergence"][1] == 2 and k7["vs_tandem_no_spec"] == 2.5
    assert (eager["streams"], eager["token_identical_to_no_spec"]) == (1, 1)
    assert (compiled["streams"], compiled["token_identical_to_no_spec"]) == (1, 0)
    assert k7["vs_hf_compiled"] == 5.0 and eager["vs_tandem_no_spec"] == 0.2
    assert res["goals"]["best_eagle3_vs_no_spec"] == 2.5
    assert res["goals"]["best_eagle3_at_least_2.5x_no_spec"] is True


def test_the_table_goals_join_the_headline_goals_and_count_the_engine_default():
    from bench.fig1_single_stream import single_stream_ratios

    res = {"tandem": {"no_spec": {"tokens_per_s": 100.0},
                      "engine_default": {"tokens_per_s": 260.0},
                      "ngram_k5": {"tokens_per_s": 300.0}},
           "hf": {}, "goals": {"engine_default_best_domain": "code"}}
    single_stream_ratios(res, {})
    assert res["goals"]["engine_default_best_domain"] == "code"
    assert res["goals"]["best_eagle3_vs_no_spec"] == 2.6  # n-gram is not EAGLE-3
