"""A repeated prompt reuses cached KV blocks, skips their prefill, and gives the same output."""

from __future__ import annotations

from engine import SamplingParams
from tests.helpers import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def test_repeated_prompt_hits_prefix_cache_real_model(smol_engine, chat_ids):
    eng = smol_engine.with_config()
    prompt = chat_ids[5]
    bs = eng.config.block_size
    first = eng.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == 0
    prefill_before = eng.stats.prefill_tokens
    hits_before = eng.blocks.prefix_hit_tokens
    second = eng.generate([prompt], GREEDY)[0]
    expected = (len(prompt) - 1) // bs * bs  # every full block but the one with the last token
    assert expected > 0
    assert second.cached_tokens == expected
    assert eng.blocks.prefix_hit_tokens - hits_before == expected
    assert eng.stats.prefill_tokens - prefill_before == len(prompt) - expected
    assert second.token_ids == first.token_ids
    eng.blocks.check_all_free()


def test_shared_prefix_reuses_blocks_while_running():
    eng = tiny_engine(1)
    shared = list(range(1, 33))  # 8 full blocks of 4
    a = eng.add_request(shared + [40, 41], GREEDY)
    eng.step()
    b = eng.add_request(shared + [50], GREEDY)
    eng.step()
    sa, sb = eng.seqs[a], eng.seqs[b]
    assert sb.num_cached_tokens == 32
    assert sa.block_table[:8] == sb.block_table[:8]
    assert all(eng.blocks.ref[blk] == 2 for blk in sb.block_table[:8])
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_all_free()


def test_prefix_cache_off_computes_everything():
    eng = tiny_engine(2, enable_prefix_caching=False)
    prompt = list(range(1, 30))
    eng.generate([prompt], GREEDY)
    out = eng.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 0
    assert eng.stats.prefill_tokens == 2 * len(prompt)


def test_evicted_blocks_are_not_reused_stale():
    """A freed cached block handed out again must lose its hash (no stale hit)."""
    eng = tiny_engine(4, num_blocks=12)  # 48 tokens of KV
    p1 = list(range(1, 30))
    ref1 = eng.generate([p1], GREEDY)[0].token_ids
    eng.generate([list(range(100, 130))], GREEDY)  # 46 tokens: every block, evicting p1's
    again = eng.generate([p1], GREEDY)[0]
    assert again.token_ids == ref1
    eng.blocks.check_all_free()
