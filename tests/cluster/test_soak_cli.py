"""`tandem soak`'s command line: its run record, where its actors go, and clear errors, without
starting a cluster."""

from __future__ import annotations

import argparse
import os

import pytest

from cluster import soak


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    soak.add_parser(p.add_subparsers())
    return p.parse_args(["soak", *argv])


def test_the_run_record_names_the_machine_and_command():
    env = soak.environment(["soak", "--streams", "2"])
    assert env["command"] == "tandem soak --streams 2"
    assert env["machine"]["cpu_count"] == os.cpu_count()
    assert env["date"] and "git_dirty" in env


def test_actors_stay_on_the_cpu_in_fp32_by_default():
    assert soak.placement(_args()) == ("cpu", "float32", 0.0)


def test_on_a_gpu_the_actors_share_it_in_bf16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (on any machine)
    assert soak.placement(_args("--device", "cuda", "--replicas", "2")) == \
        ("cuda", "bfloat16", 0.25)
    assert soak.placement(_args("--device", "cuda:0", "--replicas", "3")) == \
        ("cuda:0", "bfloat16", 0.1666)
    assert soak.placement(_args("--device", "cuda", "--dtype", "float32",
                                "--gpu-share", "0.5"))[1:] == ("float32", 0.5)


@pytest.mark.parametrize("argv,word", [(("--device", "tpu"), "--device"),
                                       (("--device", "cuda", "--gpu-share", "0"), "--gpu-share"),
                                       (("--gpu-share", "1.5"), "--gpu-share"),
                                       (("--gpu-share", "0.5"), "--gpu-share")])
def test_bad_placement_is_a_clear_error(argv, word, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = _args(*argv)
    with pytest.raises(ValueError, match=word):
        soak.placement(args)
    assert soak.cmd_soak(args) == 2
    assert word in capsys.readouterr().err


def test_what_would_fail_late_is_refused_before_the_cluster_starts(capsys, monkeypatch,
                                                                    tmp_path):
    """CUDA without a GPU (the actors waited for one forever), an --out that is a folder or
    cannot be written (found after the soak's minutes), and a malformed --address."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, says in [(("--device", "cuda"), "no CUDA device here"),
                       (("--out", str(tmp_path)), "a folder; name the JSON file"),
                       (("--out", "/proc/tandem/soak.json"), "--out /proc/tandem/soak.json")]:
        assert soak.cmd_soak(_args(*argv)) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--address", "a b")
    assert "--address" in capsys.readouterr().err


def test_engine_settings_carry_the_placement():
    from cluster.soak_cluster import engine_kwargs

    kw = engine_kwargs(64, "cuda", "bfloat16")
    assert (kw["device"], kw["dtype"], kw["kv_cache_bytes"]) == ("cuda", "bfloat16", 64 << 20)
    assert "device" not in engine_kwargs()
    # on a shared GPU the KV cache is sized from the actor's share, not 0.85 of the GPU
    assert "gpu_memory_utilization" not in kw
    assert engine_kwargs(64, "cuda", "bfloat16", 0.25)["gpu_memory_utilization"] == 0.125
    assert engine_kwargs(64, "cuda", "bfloat16", 0.25, True)["deterministic"] is True
    assert "deterministic" not in kw


@pytest.mark.parametrize("argv", [("--minutes", "nan"), ("--prompts", "0"), ("--minutes", "0")])
def test_a_soak_that_could_not_run_is_refused(argv, capsys):
    assert soak.cmd_soak(_args(*argv)) == 2
    assert "want --streams" in capsys.readouterr().err


def _result(outcomes, completed=1, lost=0):
    return {"completed_streams": completed, "outcomes": outcomes, "outputs_differing": 0,
            "tokens": {"lost": lost, "duplicated": 0}, "leaked_blocks": 0}


def test_a_soak_is_clean_only_if_streams_completed_and_none_failed():
    from cluster.soak_report import clean

    assert clean(_result({"completed": 3, "cancelled": 1}))
    assert not clean(_result({"UNAVAILABLE": 1}, completed=0))  # nothing was served
    assert not clean(_result({"completed": 3, "INTERNAL": 1}))
    assert not clean(_result({"completed": 3, "truncated": 1}))
    assert not clean(_result({"completed": 3}, lost=2))
