"""`tandem train-eagle3 --resume` on a tiny random target (CPU): a run cut short, by its
training loop's `stop` or between self-distillation chunks, and continued in further runs
gives the same records, step count, history and bit-equal head as one uninterrupted run."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import weakref

import pytest
import torch
from safetensors.torch import load_file

from cluster import prompt_sets, train_eagle3
from cluster.eagle3 import resume
from cluster.eagle3.loop import train
from cluster.eagle3.records import draft_vocab, self_distill
from engine import jit_watch
from engine.spec.eagle3 import Eagle3Config
from engine.testing import tiny_engine
from tests.spec.test_trainer import _distilled, _Tok


def _stop_after(n: int):
    """A `stop()` that ends the run at its n-th question."""
    asked = [0]

    def stop() -> bool:
        asked[0] += 1
        return asked[0] >= n

    return stop


def _same_heads(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_training_cut_short_twice_and_resumed_gives_the_same_head(tmp_path):
    prompts = [f"resume prompt {i} about {w}" for i, w in enumerate("abcdefgh")]
    eng, recs, held = _distilled(prompts, 6, 10)
    vocab = draft_vocab(recs, 64, 256)
    kw = dict(unroll=2, epochs=4, lr=3e-3, batch_size=3, log_every=3)  # 2 batches an epoch
    torch.manual_seed(0)  # the fresh head's weights (the command seeds with --seed)
    whole, info = train(eng, recs, held, vocab, **kw)
    assert info["steps"] == 8 and not info["stopped"]
    path, key = str(tmp_path / "resume.pt"), {"run": 1}
    assert resume.load_state(path, key) is None

    def save(st):
        resume.save_state(path, key, st)

    state = None
    torch.manual_seed(0)
    for stop_at, steps in ((3, 3), (3, 6), (None, 8)):  # cut mid-epoch, then past a log
        head, got = train(eng, recs, held, vocab, state=state, save_state=save,
                          stop=_stop_after(stop_at) if stop_at else None, **kw)
        assert got["steps"] == steps and got["stopped"] == (stop_at is not None)
        state = resume.load_state(path, key)
        assert state["step"] == steps
    assert _same_heads(head, whole)
    assert got["history"] == info["history"] and got["final_lr"] == info["final_lr"]
    assert got["resumed_at_step"] == 6
    # a finished state trains no further; a state of other settings is refused
    again, done = train(eng, recs, held, vocab, state=state, **kw)
    assert done["steps"] == 8 and _same_heads(again, whole)
    with pytest.raises(ValueError, match="other settings"):
        resume.load_state(path, {"run": 2})


def test_distillation_cut_short_resumes_from_the_chunks_it_wrote(tmp_path):
    prompts = [f"chunk prompt {i} on {w}" for i, w in enumerate("abcde")]
    eng, _, _ = _distilled(prompts[:1], 1, 4)
    layers = Eagle3Config.for_target(eng.config.model, 1).aux_layer_ids
    made = []

    def distil(ps):
        made.append(len(ps))
        return self_distill(eng, ps, 12, layers, torch.float32, desc=None)

    key = {"max_tokens": 12}
    whole = resume.distill_chunks(str(tmp_path / "a"), "train", key, prompts, distil,
                                  chunk=2)
    assert made == [2, 2, 1] and len(whole) == 5
    made.clear()
    cut = str(tmp_path / "b")
    # stop() is asked once a chunk is done: a run always makes one, whatever the limit
    assert resume.distill_chunks(cut, "train", key, prompts, distil, lambda: True,
                                 chunk=2) is None
    assert made == [2] and sorted(os.listdir(cut)) == ["train-00000.pt"]
    made.clear()
    got = resume.distill_chunks(cut, "train", key, prompts, distil, chunk=2)
    assert made == [2, 1]  # the first chunk is read back, not answered again
    assert all(torch.equal(a.ids, b.ids) and torch.equal(a.aux, b.aux)
               and torch.equal(a.hidden, b.hidden) and a.prompt_len == b.prompt_len
               for a, b in zip(got, whole, strict=True))
    with pytest.raises(ValueError, match="other prompts or settings"):
        resume.distill_chunks(cut, "train", {"max_tokens": 13}, prompts, distil, chunk=2)


def _cli(monkeypatch, out: str, *extra: str, stop_at: int | None = None,
         acceptance=None, engine=None) -> int:
    """`tandem train-eagle3` on the tiny target (or `engine`), a two-domain mix of chat
    messages, chunks of 4 prompts; `stop_at`: the run's `stop()` ends it at that question;
    `acceptance`: in place of the held-out acceptance runs."""
    eng = engine or _distilled(["x"], 1, 1)[0]
    eng.tokenizer = _Tok()
    monkeypatch.setattr(train_eagle3.Engine, "from_pretrained", lambda *a, **kw: eng)

    def mix(spec, path=None, seed=0):
        talk = [[{"role": "user", "content": f"talk {i}"}, {"role": "assistant", "content":
                 "ok"}, {"role": "user", "content": f"more {i} on {w}"}]
                for i, w in enumerate("abcdefghij")]
        return talk[:8], {"chat": talk[8:], "math": [[{"role": "user", "content": "1+1"}]]}

    monkeypatch.setattr(prompt_sets, "mix", mix)
    monkeypatch.setattr(resume, "CHUNK", 4)
    monkeypatch.setattr(train_eagle3, "_stopper",
                        lambda args: _stop_after(stop_at) if stop_at else None)
    monkeypatch.setattr(train_eagle3, "engine_acceptance", acceptance or (
        lambda engine, head, ps, k, n: {"k": k, "prompts": len(ps)}))
    p = argparse.ArgumentParser()
    train_eagle3.add_parser(p.add_subparsers(), "train an EAGLE-3 head")
    argv = ["train-eagle3", "--domains", "chat,math", "--out", out, "--device", "cpu",
            "--max-tokens", "8", "--draft-vocab", "64", "--unroll", "2", "--epochs", "2",
            "--batch-size", "2", "--log-every", "5", "--eval-prompts", "2", *extra]
    args = p.parse_args(argv)
    args.argv = argv
    return train_eagle3.run(args)


def test_the_command_cut_short_and_run_again_equals_one_run(monkeypatch, tmp_path):
    """Cut once in self-distillation (after its first chunk) and once in training: the same
    command run again ends with exit status 0, the same head (bit-equal), steps and history
    as a run never cut; acceptance is reported per domain."""
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    os.makedirs(whole)
    os.makedirs(cut)
    assert _cli(monkeypatch, whole, "--resume") == 0
    assert _cli(monkeypatch, cut, "--resume", "--stop-after", "60", stop_at=1) == 3
    assert sorted(os.listdir(os.path.join(cut, "records"))) == ["train-00000.pt"]
    assert _cli(monkeypatch, cut, "--resume", "--stop-after", "60", stop_at=4) == 3
    with open(os.path.join(cut, "training.json")) as f:
        assert json.load(f)["unfinished"]
    assert _cli(monkeypatch, cut, "--resume", "--stop-after", "60") == 0
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (whole, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.load(open(os.path.join(d, "training.json"))) for d in (whole, cut))
    assert ra["steps"] == rb["steps"] == ra["steps_asked"] == 8  # 4 batches x 2 epochs
    assert ra["history"] == rb["history"] and rb["resumed_at_step"] > 0
    assert rb["held_out_engine_acceptance"]["chat"][0] == {"k": 1, "prompts": 2}
    assert set(rb["held_out_engine_acceptance"]) == {"chat", "math"}
    # other settings on the same folder are refused rather than mixed in
    assert _cli(monkeypatch, cut, "--resume", "--max-tokens", "9") == 2


def _tensors(obj) -> list:
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(
        obj, (list, tuple)) else []
    return [t for it in items for t in _tensors(it)]


def _watch_records(monkeypatch) -> list:
    """Weak references to the aux tensors of every record the run self-distils."""
    made, distill_chunks = [], resume.distill_chunks

    def watched(*a, **kw):
        recs = distill_chunks(*a, **kw)
        made.extend(weakref.ref(r.aux) for r in recs or [])
        return recs

    monkeypatch.setattr(resume, "distill_chunks", watched)
    return made


def test_records_optimizer_and_resumed_state_are_freed_before_the_acceptance_runs(
        monkeypatch, tmp_path):
    """By the held-out acceptance runs, train-eagle3 holds no record, no optimizer, no state
    a resumed run loaded and no self-distillation KV pool: on an 80 GB GPU they held the
    memory those runs' engines needed."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    assert _cli(monkeypatch, out, "--resume", "--stop-after", "60", stop_at=4) == 3
    assert os.path.exists(os.path.join(out, "resume.pt"))
    loaded, load_state = [], resume.load_state

    def watched_state(path, key):
        st = load_state(path, key)
        loaded.extend(weakref.ref(t) for t in _tensors(st))
        return st

    alive = []

    def optimizers():  # alive in this process (another test's may linger: compared before)
        gc.collect()
        return sum(isinstance(o, torch.optim.Optimizer) for o in gc.get_objects())

    def acceptance(engine, head, ps, k, n):
        alive.append((sum(r() is not None for r in loaded + made), optimizers() - before,
                      engine.config.num_blocks,  # not self-distillation's KV pool either
                      jit_watch._warn_from))  # compiles here are no serving stalls
        return {"k": k}

    monkeypatch.setattr(resume, "load_state", watched_state)
    made = _watch_records(monkeypatch)
    before = optimizers()
    # marked ready, as self-distillation's first generate on a GPU marks it (undone after)
    monkeypatch.setattr(jit_watch, "_warn_from", time.perf_counter())
    assert _cli(monkeypatch, out, "--resume", acceptance=acceptance) == 0
    assert loaded and made  # the run did load a state and its records
    assert alive and alive == [(0, 0, 8, None)] * len(alive)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_run_on_the_gpu_ends_with_acceptance_and_its_records_freed(monkeypatch, tmp_path,
                                                                    capsys):
    """On CUDA (records in bf16 on the device, held-out runs through the Triton kernels): the
    command ends with exit status 0 and acceptance per domain, no record alive by then."""
    eng = tiny_engine(0, device="cuda", block_size=16, max_num_seqs=32,
                      enable_prefix_caching=False)
    made, seen, real = _watch_records(monkeypatch), [], train_eagle3.engine_acceptance

    def acceptance(engine, head, ps, k, n):
        gc.collect()
        seen.append(sum(r() is not None for r in made))
        return real(engine, head, ps, k, n)

    out = str(tmp_path / "run")
    os.makedirs(out)
    assert _cli(monkeypatch, out, "--resume", "--device", "cuda", engine=eng,
                acceptance=acceptance) == 0, capsys.readouterr().err
    assert made and seen and not any(seen), seen
    assert "GB free" in capsys.readouterr().out  # the device memory line
    with open(os.path.join(out, "training.json")) as f:
        got = json.load(f)["held_out_engine_acceptance"]
    assert set(got) == {"chat", "math"}
    assert all(r["verify_steps"] > 0 and r["acceptance_length"] >= 1 for rs in got.values()
               for r in rs), got


def test_unusable_saved_files_are_refused_in_one_line_before_distilling(monkeypatch, tmp_path,
                                                                        capsys):
    """A torn, empty or foreign resume.pt or records chunk: exit status 2 and one line naming
    the file, before the target answers a prompt (not a traceback after minutes of it)."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    assert _cli(monkeypatch, out, "--resume", "--stop-after", "60", stop_at=4) == 3
    state, chunk = os.path.join(out, "resume.pt"), os.path.join(out, "records", "train-00000.pt")
    assert os.path.exists(state) and os.path.exists(chunk)
    os.remove(os.path.join(out, "records", "eval-00000.pt"))  # a part left to distil
    with open(chunk, "rb") as f:
        whole_chunk = f.read()

    def no_distilling(*a, **kw):
        raise AssertionError("the target answered before the refusal")

    monkeypatch.setattr(train_eagle3, "self_distill", no_distilling)
    capsys.readouterr()
    for path, write, says in [
            (state, lambda f: f.write(b"not a torch file"), "cannot be read"),
            (state, lambda f: None, "cannot be read"),  # empty
            (state, lambda f: torch.save(torch.zeros(2), f), "not a file train-eagle3 wrote"),
            (state, lambda f: torch.save({"key": 1}, f), "not a file train-eagle3 wrote"),
            (chunk, lambda f: f.write(whole_chunk[: len(whole_chunk) // 2]), "cannot be read")]:
        keep = open(path, "rb").read()
        with open(path, "wb") as f:
            write(f)
        assert _cli(monkeypatch, out, "--resume") == 2
        err = [x for x in capsys.readouterr().err.splitlines() if "req/s" not in x and x]
        assert len(err) == 1 and err[0].startswith(f"error: {path} ") and says in err[0], err
        with open(path, "wb") as f:
            f.write(keep)


def test_an_init_head_of_another_shape_is_refused_before_distilling(monkeypatch, tmp_path,
                                                                      capsys):
    """An --init head of another target's shape is refused in one line once the target
    loads, before it answers a prompt; with no held-out prompt the acceptance is recorded as
    not measured (None), not as 0."""
    out, init = str(tmp_path / "run"), "assets/eagle3-smollm2-135m-instruct"
    real = train_eagle3.self_distill

    def no_distilling(*a, **kw):
        raise AssertionError("the target answered before the refusal")

    monkeypatch.setattr(train_eagle3, "self_distill", no_distilling)
    capsys.readouterr()
    assert _cli(monkeypatch, out, "--init", init) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if "req/s" not in x and x]
    assert len(err) == 1 and err[0].startswith(f"error: --init {init}: ValueError: ")
    assert "do not fit the target" in err[0]
    monkeypatch.setattr(train_eagle3, "self_distill", real)
    assert _cli(monkeypatch, out, "--eval-prompts", "0") == 0
    with open(os.path.join(out, "training.json")) as f:
        assert json.load(f)["held_out_engine_acceptance"] == {"chat": None, "math": None}
