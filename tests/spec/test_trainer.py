"""The EAGLE-3 trainer end to end on a tiny random target: self-distil through the engine,
build the draft vocabulary, train a few steps, save in the public layout, load, serve."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from cluster import train_eagle3
from cluster.eagle3.loop import PLAN_AFTER, train
from cluster.eagle3.records import draft_vocab, self_distill
from cluster.eagle3.ttt import expected_acceptance
from engine import Engine, SamplingParams
from engine.attention import TorchAttention
from engine.config import SpecConfig
from engine.spec.eagle3 import Eagle3Config, load_head, save_head
from engine.testing import random_head
from tests.helpers import tiny_engine


class _Tok:
    """Just enough tokenizer for chat prompts on a 256-token random model."""

    eos_token_id = None

    def apply_chat(self, messages, specials_in_content=False):
        return [ord(c) % 256 for c in messages[-1]["content"]][:24]

    def decode(self, ids):
        return ""


def _distilled(prompts: list[str], n_train: int, tokens: int):
    """A tiny random target (seeded: head init and batch order do not depend on the tests
    run before) and its self-distilled records: the first n_train prompts, then the rest."""
    torch.manual_seed(0)
    eng = tiny_engine(0, max_num_seqs=32, enable_prefix_caching=False)
    eng.tokenizer = _Tok()
    layers = Eagle3Config.for_target(eng.config.model, 1).aux_layer_ids
    recs = self_distill(eng, prompts[:n_train], tokens, layers, torch.float32)
    held = self_distill(eng, prompts[n_train:], tokens, layers, torch.float32,
                        desc="held-out")
    return eng, recs, held


def _serves_like_plain(eng, head, max_tokens: int) -> bool:
    """Whether greedy output with `head` drafting (K=3) equals plain decoding's."""
    spec = Engine(replace(eng.config, spec=SpecConfig(num_tokens=3, dynamic=False)),
                  weights_of=eng, draft_head=head)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [[5, 6, 7, 8, 9], [40, 41, 42]]
    return [c.token_ids for c in spec.generate(ids, sp)] == \
        [c.token_ids for c in eng.generate(ids, sp)]


def test_trainer_runs_end_to_end_and_learns(tmp_path):
    prompts = [f"prompt number {i} about {w}" for i, w in enumerate("abcdefghijklmnopqrst")]
    eng, recs, held = _distilled(prompts, 16, 24)
    assert len(recs) == 16 and all(r.aux.shape == (len(r.ids) - 1, 3 * 64) for r in recs)
    assert eng.capture is None  # the tap is removed afterwards
    vocab = draft_vocab(recs, 64, 256)
    assert vocab.shape == (64,) and torch.equal(vocab, vocab.sort().values)
    head, info = train(eng, recs, held, vocab, unroll=3, epochs=8, lr=3e-3, batch_size=4,
                       log_every=16)
    hist = info["history"]
    assert hist and hist[-1]["loss"] < hist[0]["loss"]
    assert hist[-1]["eval_expected_acceptance"] > 1.0
    assert 1.0 <= hist[-1]["eval_tokens_per_forward"] <= 1 + 3  # unroll 3
    assert expected_acceptance([0.5, 0.5]) == 1.75
    save_head(head, str(tmp_path), dtype=torch.float32)
    back = load_head(str(tmp_path), eng.config.model,
                     lambda c: TorchAttention(c.num_heads, c.num_kv_heads, c.head_dim, 4))
    spec = Engine(replace(eng.config, spec=SpecConfig(num_tokens=3, dynamic=False)),
                  weights_of=eng, draft_head=back)
    sp = SamplingParams(temperature=0, max_tokens=20)
    ids = [[5, 6, 7, 8, 9]]
    assert spec.generate(ids, sp)[0].token_ids == eng.generate(ids, sp)[0].token_ids


def test_self_distillation_replays_the_graphs_and_records_what_eager_steps_do(monkeypatch):
    """A target with graph sets (as one on CUDA builds them; here they run eagerly) is tapped
    through them: `set_tap` switches to sets built for the aux layers, so its steps replay
    them rather than fall back to the eager path, and the records equal an engine's without
    graphs; clearing the tap switches back, and a later tap reuses the tapped sets."""
    from engine.graphs import GraphSet

    prompts = ["a prompt for the graphs", "and a second one"]
    ref = tiny_engine(0, max_num_seqs=32, enable_prefix_caching=False,
                      attention_backend="triton")  # graph sets need the Triton backend
    eng = ref.with_config()
    ref.tokenizer = eng.tokenizer = _Tok()
    layers = Eagle3Config.for_target(eng.config.model, 1).aux_layer_ids
    want = self_distill(ref, prompts, 12, layers, torch.float32, desc=None)
    eng.runner.enable_graphs(32, range(1, 2), ())
    replays, run = [], GraphSet.run
    monkeypatch.setattr(GraphSet, "run", lambda g, *a, **kw: replays.append(g) or run(g, *a, **kw))
    plain = eng.runner.graphs
    got = self_distill(eng, prompts, 12, layers, torch.float32, desc=None)
    assert len(replays) >= 11  # the decode steps, at least
    tapped, n = {id(g) for g in replays}, len(replays)
    assert eng.capture is None and eng.runner.graphs is plain  # the tap cleared: back
    self_distill(eng, prompts[:1], 4, layers, torch.float32, desc=None)
    assert len(replays) > n and {id(g) for g in replays[n:]} <= tapped  # the same sets again
    for g, w in zip(got, want, strict=True):
        assert g.ids.tolist() == w.ids.tolist()
        assert torch.allclose(g.aux, w.aux, atol=1e-5)
        assert torch.allclose(g.hidden, w.hidden, atol=1e-5)


def test_ignore_eos_runs_answers_past_the_end_of_turn():
    """`self_distill(ignore_eos=True)` writes every answer to max_tokens; without it an answer
    stops at EOS; before EOS both are the same answer."""
    prompts = ["one prompt about eos", "another prompt about eos"]
    eng, recs, _ = _distilled(prompts, 2, 20)
    layers = Eagle3Config.for_target(eng.config.model, 1).aux_layer_ids
    first = recs[0].ids[recs[0].prompt_len:].tolist()
    eng.eos_ids = {first[3]}  # the target's 4th greedy token now ends its turn
    stop = self_distill(eng, prompts, 20, layers, torch.float32, desc=None)
    past = self_distill(eng, prompts, 20, layers, torch.float32, desc=None, ignore_eos=True)
    cut = stop[0].ids[stop[0].prompt_len:].tolist()
    assert cut == first[: first.index(first[3]) + 1] and len(cut) <= 4
    assert [len(r.ids) - r.prompt_len for r in past] == [20, 20]
    assert past[0].ids.tolist() == recs[0].ids.tolist()
    assert all(len(r.aux) == len(r.ids) - 1 for r in stop + past)


def test_sampled_answers_give_other_contexts_for_the_same_prompts():
    """`self_distill(temperature=T, seed=s)` (`--sampled T`): the same prompts answered by
    sampling, each record's features one per position as for greedy answers; the same seed
    samples the same answers again, and they are not the greedy ones."""
    prompts = [f"a prompt {i} to sample from" for i in range(4)]
    eng, recs, _ = _distilled(prompts, 4, 16)
    layers = Eagle3Config.for_target(eng.config.model, 1).aux_layer_ids
    a = self_distill(eng, prompts, 16, layers, torch.float32, desc=None, temperature=1.0,
                     seed=3)
    b = self_distill(eng, prompts, 16, layers, torch.float32, desc=None, temperature=1.0,
                     seed=3)
    assert [r.ids.tolist() for r in a] == [r.ids.tolist() for r in b]
    assert [r.prompt_len for r in a] == [r.prompt_len for r in recs]
    assert any(x.ids.tolist() != y.ids.tolist() for x, y in zip(a, recs))
    assert all(r.aux.shape[0] == r.hidden.shape[0] == len(r.ids) - 1 for r in a)


def test_sampled_must_be_a_temperature():
    from types import SimpleNamespace

    from cluster.eagle3.checks import bad_numbers as _bad_numbers

    assert _bad_numbers(SimpleNamespace(sampled=0.7)) is None
    assert "--sampled" in _bad_numbers(SimpleNamespace(sampled=-1.0))
    assert "--sampled" in _bad_numbers(SimpleNamespace(sampled=float("nan")))


def test_records_round_trip_and_training_continues_from_a_head(tmp_path):
    """Self-distilled records saved apart from training load back equal (and refuse a file
    made from other prompts); a head trained further (`init`) keeps its draft vocabulary
    and starts where it stood, not from scratch."""
    import pytest

    from cluster.eagle3.records import load_records, save_records

    prompts = [f"another prompt {i} on {w}" for i, w in enumerate("abcdefghijkl")]
    eng, recs, held = _distilled(prompts, 8, 16)
    key = {"target": "tiny", "prompts": [8, 4], "max_tokens": 16}
    path = str(tmp_path / "records.pt")
    save_records(path, key, recs, held)
    tr, ev = load_records(path, key)
    assert len(tr) == 8 and len(ev) == 4
    assert all(torch.equal(a.ids, b.ids) and torch.equal(a.aux, b.aux)
               and torch.equal(a.hidden, b.hidden) and a.prompt_len == b.prompt_len
               for a, b in zip(tr + ev, recs + held))
    with pytest.raises(ValueError, match="holds records of"):
        load_records(path, {**key, "max_tokens": 32})
    vocab = draft_vocab(recs, 64, 256)
    saved = []  # (step, the head's LM head then): what a checkpoint callback is given
    first, info = train(eng, tr, ev, vocab, unroll=3, epochs=30, lr=3e-3, batch_size=4,
                        log_every=2, checkpoint=lambda h, e: saved.append(
                            (e["step"], h.lm_head.weight.detach().clone())))
    # a checkpoint at every logged evaluation but the last (the caller saves that head)
    assert [s for s, _ in saved] == [h["step"] for h in info["history"][:-1]]
    assert len(saved) > 2 and not torch.equal(saved[0][1], saved[-1][1])
    d2t = first.d2t.clone()
    other = torch.arange(64) * 3  # a vocabulary `init` must ignore
    again, info2 = train(eng, tr, ev, other, unroll=3, epochs=1, lr=1e-4, batch_size=4,
                         log_every=1, init=first)
    assert torch.equal(again.d2t, d2t)
    # one small step on from the trained head: held-out accuracy where training left it,
    # above a fresh head's after its first step
    fresh, info3 = train(eng, tr, ev, vocab, unroll=3, epochs=1, lr=1e-4, batch_size=4,
                         log_every=1)
    trained, start, cont = info["history"][-1], info2["history"][0], info2["history"][1]
    new = info3["history"][0]
    # a continued run's history opens with the head it was given, before any step
    assert start["step"] == 0 and start["loss"] is None and new["step"] == 1
    assert start["eval_acc_per_step"] == trained["eval_acc_per_step"]
    assert all(abs(a - b) < 0.02 for a, b in zip(cont["eval_acc_per_step"],
                                                 trained["eval_acc_per_step"]))
    assert cont["eval_expected_acceptance"] > new["eval_expected_acceptance"]


def test_a_time_budget_shortens_training_and_its_schedule():
    """`max_seconds` plans the steps from the pace of the first ones: far fewer than the
    epochs ask, each timed, the learning rate run down to its end and a last evaluation."""
    prompts = [f"a budget prompt {i} on {w}" for i, w in enumerate("abcdefghij")]
    eng, recs, held = _distilled(prompts, 8, 12)
    vocab = draft_vocab(recs, 64, 256)
    t0 = time.perf_counter()
    _, info = train(eng, recs, held, vocab, unroll=2, epochs=5000, lr=3e-3, batch_size=4,
                    log_every=10**6, max_seconds=2.0)
    took = time.perf_counter() - t0
    assert info["steps_asked"] == 10000 and PLAN_AFTER <= info["steps"] < 10000
    # No bound on the wall time: the plan follows the pace of the first steps, which a loaded
    # host slows, so only the step count (far below the 10000 asked) shows the budget.
    assert info["train_seconds"] <= round(took, 1)
    if info["steps"] > PLAN_AFTER:
        assert info["final_lr"] < 1e-3 * 3e-3  # the cosine ended with the plan
    else:  # the first steps alone spent the budget (a loaded host): training stops there
        assert info["train_seconds"] >= 2.0
    assert [h["step"] for h in info["history"]] == [info["steps"]]
    _, full = train(eng, recs, held, vocab, unroll=2, epochs=2, lr=3e-3, batch_size=4,
                    log_every=10**6, max_seconds=600.0)
    assert full["steps"] == full["steps_asked"] == 4  # a budget that fits changes nothing


def test_extended_prompt_set_keeps_the_base_split():
    """The extended set adds prompts on both sides of the split; the base set (the
    benchmarks' held-out prompts) is the same with or without it, and no prompt changes
    sides."""
    from cluster import prompt_sets

    base_train, base_eval = prompt_sets.build()
    train_x, eval_x = prompt_sets.build(extended=True)
    assert prompt_sets.build() == (base_train, base_eval)
    assert set(base_train) <= set(train_x) and set(base_eval) <= set(eval_x)
    assert len(train_x) > 3 * len(base_train) and len(eval_x) > len(base_eval)
    assert not set(train_x) & set(eval_x)


def test_data_only_without_a_records_file_is_refused(capsys):
    from types import SimpleNamespace

    from cluster.train_eagle3 import run

    assert run(SimpleNamespace(data_only=True, records=None)) == 2
    assert "--data-only needs --records" in capsys.readouterr().err
    # --lm-head-only fits an existing head: refused before any self-distillation
    assert run(SimpleNamespace(data_only=False, records=None, lm_head_only=True,
                               init=None)) == 2
    assert "--lm-head-only fits the LM head of an --init head" in capsys.readouterr().err


def test_vocab_extension_keeps_trained_rows_and_the_fit_moves_only_new_ones():
    """`extend_vocab` adds the records' most frequent missing tokens (sorted ids, capped at
    the size asked) and keeps every trained row; `fit_lm_head` with train_ids fits those
    rows alone (the others bit-equal), lowers the loss, and the extended head serves: greedy
    output with it equals plain decoding."""
    from cluster.eagle3.vocab import extend_vocab, fit_lm_head

    prompts = [f"vocab prompt {i} of {w}" for i, w in enumerate("abcdefghijklmn")]
    eng, recs, held = _distilled(prompts, 12, 24)
    small = draft_vocab(recs, 16, 256)
    head, _ = train(eng, recs, held, small, unroll=2, epochs=1, lr=3e-3, batch_size=4,
                    log_every=100)
    big = extend_vocab(head, recs, 40)
    ids = big.draft_to_target.cpu()
    assert big.cfg.draft_vocab_size == len(ids) == 40
    assert torch.equal(ids, ids.sort().values) and torch.isin(small, ids).all()
    counts = torch.zeros(256, dtype=torch.int64)
    for r in recs:
        counts += torch.bincount(r.ids[r.prompt_len :], minlength=256)
    added = ids[~torch.isin(ids, small)]
    outside = torch.ones(256, dtype=torch.bool)
    outside[ids] = False
    outside[small] = False
    assert counts[added].min() >= counts[outside].max()  # the most frequent were taken
    pos = {int(t): i for i, t in enumerate(ids)}
    old_rows = torch.stack([big.lm_head.weight[pos[int(t)]] for t in small]).clone()
    assert torch.equal(old_rows, head.lm_head.weight.detach())
    new_rows = big.lm_head.weight[[pos[int(t)] for t in added]]
    assert (new_rows == 0).all()  # a zero logit: the trained rows still decide the argmax
    assert torch.equal(big.midlayer.mlp.down_proj.weight, head.midlayer.mlp.down_proj.weight)
    assert extend_vocab(head, recs, 10).cfg.draft_vocab_size == 16  # never smaller
    info = fit_lm_head(big, eng.model, recs, unroll=2, epochs=3, lr=1e-2, batch_size=64,
                       train_ids=added)
    fit = info["lm_head_fit"]
    assert info["fit_positions"] > 0 and fit[-1]["loss"] < fit[0]["loss"]
    after = torch.stack([big.lm_head.weight[pos[int(t)]] for t in small])
    assert torch.equal(after, old_rows)
    assert not torch.equal(big.lm_head.weight[pos[int(added[0])]],
                           eng.model.lm_head.weight[int(added[0])])
    assert _serves_like_plain(eng, big, 20)


def test_bad_numbers_and_a_missing_head_are_refused_before_the_model_loads(capsys, tmp_path):
    """Counts and rates out of range, and an --init folder with no head, end the CLI with a
    clear error (exit 2) before anything loads."""
    from types import SimpleNamespace

    from cluster.train_eagle3 import run

    bad_init = tmp_path / "bad_init"
    bad_init.mkdir()
    (bad_init / "config.json").write_text("garbage")
    list_init = tmp_path / "list_init"
    list_init.mkdir()
    (list_init / "config.json").write_text("[1, 2]")
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "training.json").write_text('{"steps": 8}')
    ok = dict(data_only=False, records=None, lm_head_only=False, init=None, draft_vocab=4096,
              max_tokens=256, unroll=5, epochs=4, batch_size=16, log_every=100, lr=1e-3,
              max_seconds=None, num_prompts=None, eval_prompts=32)
    for field, value, text in [("draft_vocab", 0, "--draft-vocab must be positive"),
                               ("lr", -1e-3, "--lr must be positive"),
                               ("batch_size", 0, "--batch-size must be positive"),
                               ("max_seconds", 0.0, "--max-seconds must be positive"),
                               ("eval_prompts", -1, "--eval-prompts must be 0 or more"),
                               ("init", str(tmp_path), "--init: no EAGLE-3 head in"),
                               ("revocab", True, "--revocab rebuilds the draft vocabulary"),
                               ("max_seconds", float("inf"), "--max-seconds must be positive"),
                               ("lr", float("inf"), "--lr must be positive"),
                               ("k_eval", 0, "--k-eval must be at least 1"),
                               ("device", "tpu", "--device: 'tpu' is not cpu"),
                               ("out", __file__, "a file, not a folder"),
                               ("model", "/nonexistent/model", "--model: no model at"),
                               ("init", str(bad_init), "config.json is not readable JSON"),
                               ("domains", "", "--domains is empty"),
                               ("init", str(list_init), "holds no JSON object"),
                               ("records", str(tmp_path), "a folder; name a file"),
                               ("records", "/nonexistent/dir/r.pt", "its folder does not"),
                               ("out", str(finished), "holds a finished head")]:
        assert run(SimpleNamespace(**{**ok, field: value})) == 2
        assert text in capsys.readouterr().err
    # an unfinished run's folder is no finished head; --resume continues even a finished one
    (finished / "training.json").write_text('{"unfinished": true}')
    assert run(SimpleNamespace(**{**ok, "out": str(finished), "draft_vocab": 0})) == 2
    assert "--draft-vocab" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert run(SimpleNamespace(**{**ok, "device": "cuda"})) == 2
        assert "no CUDA device here" in capsys.readouterr().err


def test_engine_acceptance_speculates_from_its_first_step(monkeypatch):
    """The held-out engine acceptance of `tandem train-eagle3`: its engine replays no graphs,
    so on CUDA its first `generate` cannot decode plainly while speculative graphs wait
    (`engine/warming.py`): a domain run there read 0 verify steps for every domain and K."""
    eng = tiny_engine(0, enable_prefix_caching=False)
    eng.tokenizer = _Tok()
    built = []
    real = train_eagle3.Engine
    monkeypatch.setattr(train_eagle3, "Engine",
                        lambda cfg, **kw: built.append(cfg) or real(cfg, **kw))
    got = train_eagle3.engine_acceptance(eng, random_head(eng), ["first prompt", "second"], 3, 12)
    assert [c.cuda_graphs for c in built] == [False]
    assert got["k"] == 3 and got["verify_steps"] > 0 and got["acceptance_length"] >= 1
    assert len(got["accept_rate_per_pos"]) == 3


def test_revised_vocab_is_the_new_answers_most_frequent_tokens_with_kept_rows():
    """`revise_vocab`: the draft vocabulary becomes the records' `size` most frequent
    response tokens, whatever the head had; rows of tokens it keeps are the trained ones, new
    rows zero, the body unchanged; the head still serves losslessly."""
    from cluster.eagle3.records import most_frequent, response_counts
    from cluster.eagle3.vocab import revise_vocab

    prompts = [f"revise prompt {i} of {w}" for i, w in enumerate("abcdefghijklmn")]
    eng, recs, held = _distilled(prompts, 12, 24)
    first = draft_vocab(recs[:3], 24, 256)  # a vocabulary of other (fewer) answers
    head, _ = train(eng, recs[:3], held, first, unroll=2, epochs=1, lr=3e-3, batch_size=4,
                    log_every=100)
    new = revise_vocab(head, recs, 20)
    ids = new.draft_to_target.cpu()
    want = most_frequent(response_counts(recs, 256), 20).sort().values
    assert torch.equal(ids, want) and new.cfg.draft_vocab_size == 20
    kept = ids[torch.isin(ids, first)]
    assert 0 < len(kept) < 20  # some rows carried over, some new
    row = {int(t): i for i, t in enumerate(first)}
    at = {int(t): i for i, t in enumerate(ids)}
    for t in ids.tolist():
        got = new.lm_head.weight[at[t]]
        assert torch.equal(got, head.lm_head.weight[row[t]]) if t in row else (got == 0).all()
    assert torch.equal(new.fc.weight, head.fc.weight)
    assert _serves_like_plain(eng, new, 16)
