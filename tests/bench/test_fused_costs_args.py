"""bench.fused_costs refuses a bad module setting before any model loads."""

import pytest


@pytest.mark.parametrize("item,msg", [("engine.spec.fused.NOPE=1", "has no NOPE"),
                                      ("engine.spec.fused.FOLD_CHAIN", "not module.NAME=VALUE")])
def test_fused_costs_refuses_bad_settings(item, msg, capsys):
    from bench.fused_costs import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", "--set", item])
    assert e.value.code == 2 and msg in capsys.readouterr().err
