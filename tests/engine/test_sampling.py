"""Sampler behaviour and request validation."""

from __future__ import annotations

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
    p = processed_probs(logits, SamplingParams(top_p=0.1))  # at least one token stays
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0, 0]]))
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
