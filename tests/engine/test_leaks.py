"""No KV block outlives its request: random traffic with cancellations and preemption."""

from __future__ import annotations

import random

from engine import SamplingParams
from tests.helpers import tiny_engine


def test_200_random_requests_with_cancellations_free_every_block():
    rng = random.Random(7)
    # A small cache and shared prefixes: prefix hits, preemptions and evictions all happen.
    eng = tiny_engine(5, num_blocks=48, max_num_seqs=12, max_num_batched_tokens=48)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    submitted, cancelled, finished = 0, 0, 0
    live: list[str] = []
    while submitted < 200 or eng.has_unfinished():
        if submitted < 200 and rng.random() < 0.6:
            tail = [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
            prompt = rng.choice(prefixes) + tail
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99),
                                    max_tokens=rng.randrange(1, 30), top_k=rng.choice([0, 5]))
            live.append(eng.add_request(prompt, params))
            submitted += 1
        if live and rng.random() < 0.15:
            rid = live.pop(rng.randrange(len(live)))
            cancelled += eng.abort(rid)
        for out in eng.step():
            if out.finished:
                finished += 1
                if out.request_id in live:
                    live.remove(out.request_id)
    assert cancelled > 10 and finished > 100
    assert finished + cancelled == 200
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.prefix_hit_tokens > 0
    assert not eng.seqs
    eng.blocks.check_all_free()


def test_cancel_frees_blocks_at_once():
    eng = tiny_engine(6)
    rid = eng.add_request(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=50))
    eng.step()
    assert eng.blocks.num_free < eng.num_blocks
    assert eng.abort(rid)
    eng.blocks.check_all_free()
    assert not eng.abort(rid)  # a second cancel is a no-op


def test_cancel_while_waiting():
    eng = tiny_engine(6, max_num_seqs=1)
    a = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    b = eng.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=5))
    eng.step()
    assert eng.abort(b)
    while eng.has_unfinished():
        eng.step()
    assert a not in eng.seqs
    eng.blocks.check_all_free()


def test_request_larger_than_cache_stops_with_length():
    eng = tiny_engine(8, num_blocks=6)  # 24 tokens in all
    out = eng.generate([list(range(1, 15))], SamplingParams(temperature=0, max_tokens=100))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) <= 24 + 1
    eng.blocks.check_all_free()
