"""Sampler behaviour and request validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import InvalidRequestError, ResourceExhaustedError, SamplingParams
from engine.sampler import new_generator, processed_probs, sample_from
from tests.helpers import tiny_engine


def test_seeded_sampling_is_reproducible_across_batches():
    eng = tiny_engine(0)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    alone = eng.generate([[1, 2, 3]], p)[0].token_ids
    others = [[9, 9, 9, 9], [5] * 11]
    crowd = eng.generate([others[0], [1, 2, 3], others[1]],
                         [SamplingParams(temperature=1.0, seed=5), p, SamplingParams()])
    assert crowd[1].token_ids == alone
    different = eng.generate([[1, 2, 3]], SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                         seed=4321, max_tokens=20))[0]
    assert different.token_ids != alone


def test_top_k_one_is_greedy():
    eng = tiny_engine(1)
    greedy = eng.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0, max_tokens=15))[0]
    topk1 = eng.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=1.5, top_k=1,
                                                           max_tokens=15))[0]
    assert topk1.token_ids == greedy.token_ids


def test_processed_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = processed_probs(logits, SamplingParams(top_k=2))
    assert torch.allclose(p, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    p = processed_probs(logits, SamplingParams(top_p=0.8))  # 0.5+0.2 < 0.8 → keep 3
    assert torch.allclose(p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    for top_p in (0.1, 1e-300, 5e-324):  # at least one token stays (fp32 rounds these to 0)
        p = processed_probs(logits, SamplingParams(top_p=top_p))
        assert torch.equal(p, torch.tensor([[1.0, 0, 0, 0, 0]]))
    eng = tiny_engine(1)  # a tiny top_p samples the greedy tokens, not NaN's id 0
    greedy = eng.generate([[3, 1, 4]], SamplingParams(temperature=0, max_tokens=8))[0]
    tiny = eng.generate([[3, 1, 4]], SamplingParams(temperature=1.0, top_p=1e-300, seed=1,
                                                    max_tokens=8))[0]
    assert tiny.token_ids == greedy.token_ids
    p = processed_probs(logits, SamplingParams(temperature=0.5))
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert torch.allclose(p[0], q / q.sum())


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0]])
    g = new_generator(0)
    n = 20000
    draws = torch.stack([sample_from(probs, g)[0] for _ in range(n)])
    freq = torch.bincount(draws, minlength=4).float() / n
    assert freq[3] == 0
    assert (freq - probs[0]).abs().max() < 0.015


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 1.5}, {"top_p": 0.0}, {"top_k": -1},
    {"max_tokens": 0}, {"max_tokens": -3}, {"stop": ("",)}, {"seed": -1},
    {"temperature": float("nan")},
    # wrong types: refused here, not by a step that would then fail every later call
    {"stop": [13]}, {"stop": 5}, {"top_k": 2.5}, {"seed": 1.5}, {"max_tokens": None},
    {"max_tokens": "5"}, {"temperature": "0.5"}, {"temperature": True}, {"top_p": None},
    {"stop_token_ids": [1.0]}, {"ignore_eos": 1},
])
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_nothing_behind():
    eng = tiny_engine(2, max_position=64)
    for prompt, err in [([], InvalidRequestError), ([1] * 64, InvalidRequestError),
                        ([1] * 100, InvalidRequestError), ([300], InvalidRequestError),
                        ([-1, 2], InvalidRequestError)]:
        with pytest.raises(err):
            eng.add_request(prompt, SamplingParams())
    small = tiny_engine(2, num_blocks=4)
    with pytest.raises(ResourceExhaustedError):
        small.add_request(list(range(1, 30)), SamplingParams())
    assert not eng.has_unfinished() and not eng.seqs
    eng.blocks.check_all_free()


def test_sampling_params_take_none_lists_and_integer_scalars():
    p = SamplingParams(stop=None, stop_token_ids=None, top_k=np.int64(3), seed=torch.tensor(5),
                       max_tokens=np.int32(4), temperature=np.float32(0.5))
    assert (p.stop, p.stop_token_ids, p.top_k, p.seed, p.max_tokens) == ((), (), 3, 5, 4)
    assert type(p.top_k) is int and type(p.temperature) is float


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind():
    eng = tiny_engine(2)
    g = SamplingParams(temperature=0, max_tokens=8)
    for bad in ([[1, 2, 3], [5, 9999]], [[1, 2, 3], [1.5, 2]], [[1, 2, 3], None], [[4], [True]]):
        with pytest.raises(InvalidRequestError):
            eng.generate(bad, g)
        assert not eng.seqs and not eng.has_unfinished()
        eng.blocks.check_all_free()
    assert len(eng.generate([[7, 8]], g)[0].token_ids) == 8  # the engine goes on


def test_token_ids_may_come_as_numpy_or_torch():
    eng = tiny_engine(2)
    g = SamplingParams(temperature=0, max_tokens=6)
    want = eng.generate([1, 2, 3], g)[0].token_ids
    for prompt in (np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), 2, 3]):
        assert eng.generate(prompt, g)[0].token_ids == want
    both = eng.generate(np.array([[1, 2, 3], [1, 2, 3]]), g)
    assert [c.token_ids for c in both] == [want, want]


def test_leaving_a_stream_early_aborts_it_and_an_abort_ends_it():
    eng = tiny_engine(2)
    g = SamplingParams(temperature=0, max_tokens=50)
    for _ in eng.stream([1, 2, 3], g):
        break
    assert not eng.seqs
    eng.blocks.check_all_free()
    outs = []
    for out in eng.stream([1, 2, 3], g):
        outs.append(out)
        if len(outs) == 2:
            eng.abort(out.request_id)
        assert len(outs) < 10, "the stream went on after its abort"
    assert outs[-1].finished and outs[-1].finish_reason == "cancelled" and len(outs) == 3
    eng.blocks.check_all_free()


def test_aborting_another_request_mid_stream_loses_none_of_this_ones_output():
    """An abort drains the step in flight: the streamed request's last output, held for the
    next step, still arrives."""
    eng = tiny_engine(2)
    g = SamplingParams(temperature=0, max_tokens=3)
    want = eng.generate([1, 2, 3], g)[0].token_ids
    other = eng.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=40))
    got, outs = [], []
    for out in eng.stream([1, 2, 3], g):
        outs.append(out)
        got += out.token_ids
        if len(got) == 2:
            eng.abort(other)
    assert got == want and outs[-1].finished and outs[-1].finish_reason == "length"
    eng.blocks.check_all_free()


def test_scalars_and_odd_prompt_shapes():
    assert SamplingParams(temperature=torch.tensor(0.5), top_k=torch.tensor(3)).top_k == 3
    eng = tiny_engine(2)
    g = SamplingParams(temperature=0, max_tokens=4)
    want = eng.generate([1, 2, 3], g)[0].token_ids
    assert eng.generate([torch.tensor(1), torch.tensor(2), torch.tensor(3)], g)[0].token_ids \
        == want
    with pytest.raises(InvalidRequestError):  # one message is not a prompt
        eng.generate({"role": "user", "content": "hi"}, g)
    assert not eng.seqs


def test_text_prompts_need_a_tokenizer():
    eng = tiny_engine(2)
    with pytest.raises(InvalidRequestError):
        eng.add_request("hello", SamplingParams())
    with pytest.raises(InvalidRequestError):
        eng.add_request("", SamplingParams())


def test_duplicate_request_id_is_refused():
    eng = tiny_engine(2)
    eng.add_request([1, 2], SamplingParams(), request_id="x")
    with pytest.raises(InvalidRequestError):
        eng.add_request([1, 2], SamplingParams(), request_id="x")
    eng.reserve("y", 8)  # a prefill's reserved blocks count as running too
    with pytest.raises(InvalidRequestError):
        eng.add_request([1, 2], SamplingParams(), request_id="y")


def test_bad_arguments_of_the_python_api_raise_naming_them_and_break_nothing():
    """A bad max_draft used to be kept and fail every later step of a speculative engine; a
    NaN max_num_seqs admitted nothing (generate waited forever); other types failed deep in
    torch or as AttributeErrors."""
    from engine.config import SpecConfig

    eng = tiny_engine(0, spec=SpecConfig(method="ngram", num_tokens=3))
    for kw, says in [({"max_draft": 2.5}, "max_draft must be an integer"),
                     ({"max_draft": "a"}, "max_draft must be an integer"),
                     ({"max_draft": -1}, "max_draft must be >= 0"),
                     ({"params": {"temperature": 0}}, "params must be a SamplingParams")]:
        with pytest.raises(InvalidRequestError, match=says):
            eng.add_request([5, 6, 7, 5, 6], **kw)
    for prompts in (None, 5):
        with pytest.raises(InvalidRequestError, match="prompts must be"):
            eng.generate(prompts)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert len(eng.generate([[1, 2, 3], [4, 5]], (greedy, greedy))) == 2  # a tuple of params
    assert eng.add_request([5, 6, 7, 5, 6], greedy, max_draft=np.int64(2))
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_all_free()
    for field, value in [("max_num_seqs", float("nan")), ("block_size", 4.0),
                         ("num_blocks", True), ("spec", "ngram"), ("dtype", "float16"),
                         ("device", None)]:
        with pytest.raises(TypeError, match=field):
            tiny_engine(0, **{field: value})


def test_text_with_a_lone_surrogate_is_refused_naming_where(smol_engine):
    """Half of a UTF-16 pair (JSON's escapes can spell one) is no Unicode text: refused before
    the tokenizer, which raised a bare TypeError."""
    for prompt, says in [("abc\ud800", "the prompt holds a lone surrogate at character 3"),
                         ([{"role": "user", "content": "ok"},
                           {"role": "user", "content": "x\udfff"}],
                          "message 1's content holds a lone surrogate")]:
        with pytest.raises(InvalidRequestError, match=says):
            smol_engine.generate(prompt, SamplingParams(max_tokens=2))
    smol_engine.blocks.check_all_free()
