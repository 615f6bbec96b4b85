"""bench/turns.py, behind bench/loop_copies.py and bench/policy_ab.py: the summary of dynamic
K's steps, and variants taking turns with their settings (the GPU runs are not in CI)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from bench.turns import take_turns, trace_summary


def test_trace_summary_groups_steps_by_draft_count():
    trace = [(1, 0.0, 0.5, 1, "overlapped", True), (1, 0.0, 0.7, 1, "overlapped", True),
             (1, 0.0, 0.6, 1, "fresh", False), (1, 7.0, 1.1, 8, "overlapped", True),
             (1, 7.0, 1.3, 2, "overlapped switch", True), (1, None, 3.0, None, "prefill", False)]
    got = trace_summary(trace)
    assert list(got) == ["other", "0.0", "7.0", "switches"]
    assert got["0.0"] == {"steps": 3, "median_ms": 0.6, "mean_tokens": 1.0}
    assert got["7.0"] == {"steps": 2, "median_ms": 1.2, "mean_tokens": 5.0}
    assert got["other"] == {"steps": 1, "median_ms": 3.0, "mean_tokens": 0.0}
    assert got["switches"] == 1


def test_variants_take_turns_in_rotated_order_with_their_settings(monkeypatch):
    """Each turn runs under its variant's settings (a variant naming none at the defaults,
    whatever the turn before set), the order rotates each repetition, an engine is built
    once per variant, answers are compared with the first variant's, and the settings are
    back as they were after."""
    import bench.suite
    from engine.spec import policy

    seen, built = [], []

    def run_single(args, eng, prompts, n):
        seen.append((eng.name, policy.LOSING_FRESH))
        outs = [[1, 2]] * len(prompts) if eng.name != "c" else [[1, 2], [3]]
        return {"tokens_per_s": {"a": 100.0, "b": 150.0, "c": 50.0, "d": 80.0}[eng.name],
                "acceptance_length": None, "_outs": outs}

    def with_config(spec, num_blocks):
        built.append(spec.name)
        return SimpleNamespace(name=spec.name, spec=None)

    monkeypatch.setattr(bench.suite, "run_single", run_single)
    before = policy.LOSING_FRESH
    variants = {n: (SimpleNamespace(name=n, dynamic=False),
                    {"engine.spec.policy.LOSING_FRESH": v})
                for n, v in (("a", 1), ("b", 2), ("c", 3))}
    variants["d"] = (SimpleNamespace(name="d", dynamic=False), {})
    out = take_turns(SimpleNamespace(tokens=2), SimpleNamespace(with_config=with_config),
                     [[7], [8]], variants, reps=3, num_blocks=4)
    assert policy.LOSING_FRESH == before
    assert built == ["a", "b", "c", "d"]
    d = ("d", before)  # after c's turn too: the default, not c's 3
    assert seen == [("a", 1), ("b", 2), ("c", 3), d, ("b", 2), ("c", 3), d, ("a", 1),
                    ("c", 3), d, ("a", 1), ("b", 2)]
    assert [len(v) for v in out["runs"].values()] == [3, 3, 3, 3]
    assert out["answers"] == {"prompts": [[7], [8]], "outputs": [[1, 2], [1, 2]]}
    assert [r["token_identical_to_no_spec"] for r in out["runs"]["c"]] == [1, 1, 1]
    assert "token_identical_to_no_spec" not in out["runs"]["a"][0]
    assert out["best_vs_first"] == {"a": 1.0, "b": 1.5, "c": 0.5, "d": 0.8}
    assert out["median_vs_first"]["b"] == 1.5


def test_a_reset_variant_starts_its_policy_afresh_each_turn(monkeypatch):
    import bench.suite
    from engine.config import SpecConfig
    from engine.spec.policy import KPolicy

    policies = []
    spec = SimpleNamespace(name="d", dynamic=False)
    eng = SimpleNamespace(spec=SimpleNamespace(policy=KPolicy(SpecConfig(num_tokens=3))))
    eng.spec.policy.levels = ((1, 2, 4), (0, 1, 2, 3))
    eng.spec.policy.batch_why["model"] += 5

    def run_single(args, e, prompts, n):
        policies.append(e.spec.policy)
        return {"tokens_per_s": 1.0, "acceptance_length": None, "_outs": [[1]]}

    monkeypatch.setattr(bench.suite, "run_single", run_single)
    take_turns(SimpleNamespace(tokens=1), SimpleNamespace(with_config=lambda **kw: eng),
               [[7]], {"d": (spec, {}, "reset")}, reps=3, num_blocks=4)
    assert len({id(p) for p in policies}) == 3 and not policies[1].batch_why
    assert policies[2].levels == ((1, 2, 4), (0, 1, 2, 3)) and policies[2].spec.num_tokens == 3


def test_module_settings_hold_for_the_block_only():
    """bench.common.module_settings: the constants are set inside the block and put back
    after it, an exception included; an unknown name is refused."""
    import pytest

    from bench.common import module_settings
    from engine import ops
    from engine.spec import policy

    before = (policy.MARGIN, ops.ONE_LOAD)
    with module_settings({"engine.spec.policy.MARGIN": 3.0, "engine.ops.ONE_LOAD": False}):
        assert (policy.MARGIN, ops.ONE_LOAD) == (3.0, False)
    assert (policy.MARGIN, ops.ONE_LOAD) == before
    with pytest.raises(RuntimeError):
        with module_settings({"engine.spec.policy.MARGIN": 3.0}):
            raise RuntimeError
    assert policy.MARGIN == before[0]
    with pytest.raises(AttributeError):
        with module_settings({"engine.spec.policy.NO_SUCH": 1}):
            pass


def test_suite_settings_set_module_constants_and_refuse_unknown_names():
    import pytest

    from bench.common import apply_settings
    from engine.spec import policy

    before = (policy.LOSING_FRESH, policy.FIT_SWITCHES)
    try:
        got = apply_settings(["engine.spec.policy.LOSING_FRESH=256",
                              "engine.spec.policy.FIT_SWITCHES=True"])
        assert got == {"engine.spec.policy.LOSING_FRESH": 256,
                       "engine.spec.policy.FIT_SWITCHES": True}
        assert policy.LOSING_FRESH == 256 and policy.FIT_SWITCHES is True
    finally:
        policy.LOSING_FRESH, policy.FIT_SWITCHES = before
    with pytest.raises(AttributeError):
        apply_settings(["engine.spec.policy.NO_SUCH_NAME=1"])
    with pytest.raises(ValueError):
        apply_settings(["LOSING_FRESH"])


def test_turn_scripts_start_with_no_spec_and_name_real_settings():
    """Each turn-taking script's first variant is no-spec (the baseline its ratios divide
    by), every setting names a module constant that exists, and head_ab's second head is
    the one asked for."""
    import importlib

    import bench.head_ab
    import bench.loop_copies
    import bench.policy_ab
    import bench.spec_ab

    args = SimpleNamespace(head=None, other="/heads/new", accept_model="geometric",
                           context_drafts=None, variant=None)
    for mod in (bench.loop_copies, bench.policy_ab, bench.head_ab, bench.spec_ab):
        variants = mod.variants(args)
        first = next(iter(variants.values()))
        assert first[0] is None, mod.__name__
        for _, sets, *_ in variants.values():
            for path in sets:
                module, name = path.rsplit(".", 1)
                assert hasattr(importlib.import_module(module), name), path
    heads = {n: v[0].head for n, v in bench.head_ab.variants(args).items() if v[0]}
    assert {h for n, h in heads.items() if n.startswith("other")} == {"/heads/new"}
    assert {h for n, h in heads.items() if n.startswith("shipped")} == {None}


def test_spec_ab_variants_change_only_the_fields_they_name():
    """bench.spec_ab: each variant is figure 1's dynamic K7 + context with the named SpecConfig
    fields changed; a field SpecConfig lacks, a refused value, a repeated name or a missing
    NAME: are refused before any model loads."""
    import pytest

    from bench.spec_ab import DEFAULT_VARIANTS, main, parse_variant, variants

    args = SimpleNamespace(head=None, accept_model="geometric", context_drafts=None,
                           variant=["dyn5:num_tokens=5", "fixed:dynamic=False", "same:"])
    got = variants(args)
    assert list(got) == ["no_spec", "dyn5", "fixed", "same"]
    same = got["same"][0]
    assert (same.num_tokens, same.dynamic, same.context_drafts) == (7, True, True)
    assert got["dyn5"][0] == replace(same, num_tokens=5)
    assert got["fixed"][0] == replace(same, dynamic=False)
    args.variant = None
    assert len(variants(args)) == 1 + len(DEFAULT_VARIANTS)
    assert variants(args)["dynamic_k7_dense4_context"][0].dense_levels_from == 4
    for bad in ("nocolon", ":num_tokens=5", "no_spec:", "x:not_a_field=1", "x:num_tokens=99"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    with pytest.raises(ValueError, match="twice"):
        variants(SimpleNamespace(**{**vars(args), "variant": ["a:", "a:"]}))
    with pytest.raises(SystemExit):
        main(["--variant", "x:batch_k=9"])
    # A dotted field is a module constant set for the variant's turns, beside its fields.
    name, fields, sets = parse_variant("m90:engine.spec.policy.MARGIN=0.9,batch_k=7")
    assert (name, fields, sets) == ("m90", {"batch_k": 7}, {"engine.spec.policy.MARGIN": 0.9})
    args.variant = ["m90:engine.spec.policy.MARGIN=0.9"]
    assert variants(args)["m90"] == (same, {"engine.spec.policy.MARGIN": 0.9})
    for bad in ("x:engine.spec.policy.NO_SUCH=1", "x:no.such.module.NAME=1",
                "x:engine.spec.policy.MARGIN"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    # no_spec_*: no speculation under module constants, the baseline of variants sharing them
    args.variant = ["no_spec_wide:engine.ops.WIDE_GEMV=True", "wide:engine.ops.WIDE_GEMV=True"]
    got = variants(args)
    assert got["no_spec_wide"] == (None, {"engine.ops.WIDE_GEMV": True})
    assert got["wide"] == (same, {"engine.ops.WIDE_GEMV": True})
    with pytest.raises(ValueError, match="module constants only"):
        variants(SimpleNamespace(**{**vars(args), "variant": ["no_spec_x:num_tokens=5"]}))
