"""Continuous batching and chunked prefill do not change what a request produces."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.helpers import one_thread, tiny_engine  # noqa: F401  (autouse: one intra-op thread)

GREEDY = SamplingParams(temperature=0, max_tokens=24)
# The real model's runs: with 12 tokens the requests arriving at steps 3 and 7 still decode
# when the last arrives (step 12), and each of its decode steps costs as much as a tiny run.
REAL = SamplingParams(temperature=0, max_tokens=12)


def alone(engine, prompts, params=GREEDY):
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def staggered(engine, prompts, arrive_at, params=GREEDY):
    """Submit prompt i at step arrive_at[i]; run everything to the end."""
    ids, step, pending = {}, 0, sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    outs: dict[str, list[int]] = {}
    while pending or engine.has_unfinished():
        while pending and arrive_at[pending[0]] <= step:
            i = pending.pop(0)
            ids[engine.add_request(prompts[i], params)] = i
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        step += 1
    res = [None] * len(prompts)
    for rid, i in ids.items():
        res[i] = outs[rid]
    return res


def test_mixed_batch_equals_alone_real_model(smol_engine, chat_ids):
    prompts = chat_ids[:6]
    engine = smol_engine.with_config(max_num_batched_tokens=64, enable_prefix_caching=False)
    solo = alone(engine, prompts, REAL)
    mixed = staggered(engine, prompts, arrive_at=[0, 0, 1, 3, 7, 12], params=REAL)
    assert mixed == solo
    engine.blocks.check_all_free()


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_equals_alone_tiny(seed):
    engine = tiny_engine(seed, max_num_batched_tokens=40)
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 70))] for _ in range(10)]
    solo = alone(engine, prompts)
    mixed = staggered(engine, prompts, arrive_at=[rng.randrange(8) for _ in prompts])
    assert mixed == solo


def test_chunked_prefill_equals_one_shot_real_model(smol_engine, chat_ids):
    prompt = chat_ids[4]
    assert len(prompt) > 40
    one_shot = smol_engine.with_config(enable_prefix_caching=False)
    ref = one_shot.generate([prompt], REAL)[0].token_ids
    for budget in (7, 16, 33):
        eng = smol_engine.with_config(max_num_batched_tokens=budget, enable_prefix_caching=False)
        steps_before = eng.stats.steps
        assert eng.generate([prompt], REAL)[0].token_ids == ref, f"chunk size {budget}"
        # The prompt really was split into ceil(len/budget) prefill steps.
        assert eng.stats.steps - steps_before >= -(-len(prompt) // budget)


def test_chunked_prefill_tiny_many_sizes():
    engine = tiny_engine(3)
    prompt = list(range(5, 90))
    ref = engine.generate([prompt], GREEDY)[0].token_ids
    for budget in (1, 2, 5, 13, 64):
        eng = engine.with_config(max_num_batched_tokens=budget)
        assert eng.generate([prompt], GREEDY)[0].token_ids == ref, f"chunk size {budget}"


def test_admit_whole_takes_whole_prompts_from_the_front_only():
    """`Scheduler.admit_whole` (admission beside a step in flight): whole remaining prompts
    only, from the front of the queue, stopping at the first that does not fit the budget or
    that `ok` refuses; `schedule` would have split that one into a chunk."""
    eng = tiny_engine(0, max_num_batched_tokens=64)
    sch = eng.scheduler
    rids = [eng.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=2))
            for n in (10, 20, 40, 5)]
    batch = sch.admit_whole(35, lambda s: True)
    assert batch.num_tokens == [10, 20]  # 40 does not fit the 5 left, and 5 waits behind it
    assert [s.request_id for s in sch.running] == rids[:2] and len(sch.waiting) == 2
    assert not sch.admit_whole(64, lambda s: False).seqs  # refused: nothing admitted
    batch = sch.schedule()  # the running two, then the rest of the queue in the budget
    assert batch.num_tokens == [10, 20, 34] and len(sch.waiting) == 1
