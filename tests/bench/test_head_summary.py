"""bench.common.head_summary: which EAGLE-3 head a figure ran, written into its JSON."""

import json
import os
import shutil

import pytest


def test_head_summary_names_the_shipped_head_and_tells_heads_apart(tmp_path):
    from bench.common import head_summary
    from engine.loader import ASSETS, SHIPPED_HEADS

    shipped = f"{ASSETS}/{SHIPPED_HEADS['SmolLM2-135M-Instruct']}"
    s = head_summary(shipped)
    with open(f"{shipped}/config.json") as f:
        assert s["draft_vocab_size"] == json.load(f)["draft_vocab_size"]
    assert len(s["weights_sha256"]) == 16
    assert s["trained"]["date"] and s["trained"]["eval_expected_acceptance"] > 1
    assert s["trained"]["unfinished"] is False
    other = tmp_path / "head"
    shutil.copytree(shipped, other)
    with open(other / "model.safetensors", "ab") as f:
        f.write(b"\0")  # other weights, another hash
    (other / "training.json").unlink()
    t = head_summary(str(other))
    assert t["weights_sha256"] != s["weights_sha256"] and "trained" not in t


def test_a_second_head_is_a_figure_3_candidate():
    """`--fig3-candidate head=DIR` runs dynamic K with another head in turns with the first
    (a head A/B at every concurrency): the path passes through as a string field."""
    import pytest

    from bench.common import spec_fields

    assert spec_fields("head=/tmp/heads/old") == {"head": "/tmp/heads/old"}
    assert spec_fields("head=/tmp/h, batch_k=5") == {"head": "/tmp/h", "batch_k": 5}
    with pytest.raises(ValueError, match="not SpecConfig"):
        spec_fields("heads=/tmp/h")


def test_figure_3_takes_several_candidates_in_order_and_refuses_bad_ones(capsys):
    """`--fig3-candidate` repeats: each is one more dynamic-K variant in turns with the rest,
    named in the order given (its goals keyed the same way); an empty, repeated or unknown
    candidate is refused before any model loads."""
    import pytest

    from bench.fig3_concurrency import candidate_variants
    from bench.suite import main

    dyn = "eagle3_dynamic_k7"
    assert candidate_variants(dyn, None) == {}
    assert candidate_variants(dyn, "num_tokens=5") == {f"{dyn}_candidate": {"num_tokens": 5}}
    got = candidate_variants(dyn, ["num_tokens=5", "dense_levels_from=4", "head=/tmp/h"])
    assert list(got) == [f"{dyn}_candidate", f"{dyn}_candidate2", f"{dyn}_candidate3"]
    assert got[f"{dyn}_candidate2"] == {"dense_levels_from": 4}
    assert got[f"{dyn}_candidate3"] == {"head": "/tmp/h"}
    with pytest.raises(ValueError, match="changes no SpecConfig field"):
        candidate_variants(dyn, ["num_tokens=5", " "])
    with pytest.raises(ValueError, match="repeats an earlier one"):
        candidate_variants(dyn, ["num_tokens=5", "num_tokens=5"])
    with pytest.raises(ValueError, match="not SpecConfig"):
        candidate_variants(dyn, ["num_tokens=5", "levels=4"])
    assert main(["--device", "cpu", "--figures", "3", "--fig3-candidate", "num_tokens=5",
                 "--fig3-candidate", "num_tokens=99"]) == 2
    assert "error: --fig3-candidate: " in capsys.readouterr().err


def test_set_changes_module_constants_and_refuses_unknown_names(monkeypatch):
    """`tandem bench --set module.NAME=VALUE`: a constant the module has is set (the value a
    Python literal); an unknown name or a malformed item is refused."""
    import pytest

    from bench import fig5_process
    from bench.common import SETTINGS_ENV
    from bench.suite import apply_settings

    settings_restored(monkeypatch, fig5_process, SETTINGS_ENV)
    got = apply_settings(["bench.fig5_process.FIG5_UCX_TIMEOUT_S=12.5"])
    assert got == {"bench.fig5_process.FIG5_UCX_TIMEOUT_S": 12.5}
    assert fig5_process.FIG5_UCX_TIMEOUT_S == 12.5
    with pytest.raises(AttributeError):
        apply_settings(["bench.fig5_process.NO_SUCH_NAME=1"])
    with pytest.raises(ValueError):
        apply_settings(["FIG5_UCX_TIMEOUT_S"])


def test_processes_a_figure_starts_inherit_its_settings(monkeypatch):
    """A figure's child process (figure 6's restarted process, figure 7's cold ones) runs with
    the parent's --set values (`apply_inherited`), or an A/B would compare the child unset."""
    import os
    import subprocess
    import sys

    from bench import fig5_process
    from bench.common import SETTINGS_ENV
    from bench.suite import apply_settings

    settings_restored(monkeypatch, fig5_process, SETTINGS_ENV)
    apply_settings(["bench.fig5_process.FIG5_UCX_TIMEOUT_S=7.25"])
    child = ("from bench.suite import apply_inherited; apply_inherited(); "
             "from bench import fig5_process; print(fig5_process.FIG5_UCX_TIMEOUT_S)")
    out = subprocess.run([sys.executable, "-c", child], env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "7.25"


def settings_restored(monkeypatch, module, env: str) -> None:
    """After the test: the constant `apply_settings` sets here, and the settings it leaves
    for child processes in `env` (empty now: none), back as they were."""
    monkeypatch.setattr(module, "FIG5_UCX_TIMEOUT_S", module.FIG5_UCX_TIMEOUT_S)
    monkeypatch.setenv(env, "")


@pytest.mark.parametrize("argv, says", [
    (["--figures", ""], "no figure"), (["--figures", ","], "no figure"),
    (["--figures", "3", "--concurrency", "0,-1"], "--concurrency wants positive counts"),
    (["--figures", "3", "--concurrency", "abc"], "--concurrency wants positive counts"),
    (["--figures", "6", "--device", "tpu"], "--device: 'tpu' is not cpu"),
    (["--figures", "6", "--out", __file__], "a file, not a folder"),
    (["--figures", "6", "--out", __file__ + "/x"], "is a file"),
    (["--figures", "2", "--out", "/proc/tandem-bench"], "--out '/proc/tandem-bench'"),
    (["--figures", "2", "--out", ""], "not a folder this process can write in"),
    (["--figures", "1", "--model", "/nonexistent/m.gguf"], "--model /nonexistent/m.gguf: no"),
    (["--figures", "1", "--head", "/nonexistent"], "--head /nonexistent: no such"),
    (["--figures", "3,1", "--fig1-domains", "bogus"], "--fig1-domains: unknown ['bogus']"),
    (["--figures", "6", "--fig6-streams", "abc"], "--fig6-streams wants positive counts"),
    (["--figures", "6", "--fig6-streams", "8"], "(2 of them)"),
    (["--figures", "7", "--fig7-concurrency", ""], "--fig7-concurrency wants"),
    (["--figures", "2", "--set", "..X=1"], "--set: '..X' is not module.NAME"),
    (["--figures", "2", "--set", "bench.fig5_process.FIG5_UCX_TIMEOUT_S=6O"],
     "FIG5_UCX_TIMEOUT_S is float 60.0, got '6O'"),
    (["--figures", "2", "--set", "torch.cuda.is_available=1"], "is not a constant"),
])
def test_bad_run_arguments_are_refused_before_any_figure_runs(argv, says, capsys, tmp_path,
                                                              monkeypatch):
    from bench.suite import main

    monkeypatch.chdir(tmp_path)  # a figure that ran anyway writes here, not into the repo
    args = argv if "--device" in argv else ["--device", "cpu", *argv]
    assert main(args) == 2
    assert says in capsys.readouterr().err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("flag, value", [("--fig3-reps", "0"), ("--num-blocks", "-1"),
                                         ("--fig1-tokens", "x"), ("--prompt-offset", "-2")])
def test_counts_and_sizes_are_checked_as_they_are_parsed(flag, value, capsys):
    from bench.suite import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--figures", "3", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_cuda_asked_for_without_cuda_is_refused_before_any_figure_runs(capsys, monkeypatch):
    import torch

    from bench.suite import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (on any machine)
    assert main(["--device", "cuda", "--figures", "2", "--out", "/tmp"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
