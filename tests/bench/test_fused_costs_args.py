"""bench.fused_costs refuses a bad module setting before any model loads."""

import pytest


@pytest.mark.parametrize("item,msg", [("engine.spec.fused.NOPE=1", "has no NOPE"),
                                      ("engine.spec.fused.FOLD_CHAIN", "not module.NAME=VALUE")])
def test_fused_costs_refuses_bad_settings(item, msg, capsys):
    from bench.fused_costs import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", "--set", item])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_fused_costs_times_the_attention_variant_the_engine_runs():
    """Past `long_context` keys the engine's steps take a bucket's split-KV graph where the
    batch is few enough sequences (`GraphSet.long_variant`, which `GraphSet.run` and
    bench.fused_costs both ask); the cost table must time that graph, not the one-pass."""
    from types import SimpleNamespace

    import torch

    from engine.attention.triton_backend import long_context
    from engine.graphs import GraphSet

    gs = SimpleNamespace(device=torch.device("cpu"), long_max_batch=4)
    long_variant = GraphSet.long_variant.__get__(gs)
    gs._splits = GraphSet._splits.__get__(gs)
    edge = long_context(gs.device)
    assert long_variant(2, edge + 1) and not long_variant(2, edge)
    assert not long_variant(8, edge + 1)
    gs.long_max_batch = None  # no bound: every bucket splits
    assert long_variant(64, edge + 1)
