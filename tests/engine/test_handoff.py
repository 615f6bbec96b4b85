"""Prefill on one engine, hand off (KV blocks + state), decode on another: the output equals
what one engine alone produces — greedy and seeded sampling, with and without speculation."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from bench.common import handed_off
from engine import Engine, SamplingParams
from engine.config import SpecConfig
from tests.helpers import one_thread, tiny_engine  # noqa: F401  (autouse: one intra-op thread)


def copy_blocks(src: Engine, dst: Engine, src_ids, dst_ids) -> None:
    dst.kv_cache[:, :, dst_ids] = src.kv_cache[:, :, src_ids].to(dst.kv_cache)


def disaggregated(prefill: Engine, decode: Engine, prompts, params) -> list[list[int]]:
    """Run every prompt prefill→decode, several in flight at once, like the cluster does
    (`bench.common.handed_off`); no block stays in use on either side."""
    outs = handed_off(prefill, decode, prompts, params)
    prefill.blocks.check_all_free()
    decode.blocks.check_all_free()
    return outs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=20),
])
def test_tiny_disaggregated_equals_colocated(params):
    base = tiny_engine(0, max_num_batched_tokens=32)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 50))] for _ in range(8)]
    colocated = [c.token_ids for c in base.generate(prompts, params)]
    got = disaggregated(base.with_config(), base.with_config(), prompts, params)
    assert got == colocated


def test_real_model_disaggregated_equals_colocated_with_eagle3(smol_engine, chat_ids):
    prompts = chat_ids[:8]
    spec = SpecConfig(num_tokens=3, dynamic=False)
    cfg = replace(smol_engine.config, spec=spec, enable_prefix_caching=False)
    colo = Engine(cfg, weights_of=smol_engine)
    head = colo.spec.head
    # 8 new tokens: the hand-off is at the first, the decode side verifies the other 7 in two
    # or more verify steps (K = 3).
    for params in (SamplingParams(temperature=0, max_tokens=8),
                   SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=8)):
        want = [c.token_ids for c in colo.generate(prompts, params)]
        pre = Engine(cfg, weights_of=smol_engine, draft_head=head)
        dec = Engine(cfg, weights_of=smol_engine, draft_head=head)
        assert disaggregated(pre, dec, prompts, params) == want
        assert dec.spec.stats.verify_steps > 0


def test_text_streams_identically_across_the_handoff(smol_engine, chat_ids):
    params = SamplingParams(temperature=0, max_tokens=24, stop=(".",))
    eng = smol_engine.with_config(enable_prefix_caching=False)
    whole = "".join(o.text for o in eng.stream(chat_ids[3], params))
    pre, dec = eng.with_config(), eng.with_config()
    rid = pre.add_request(chat_ids[3], params, hold=True)
    text = ""
    while pre.has_unfinished():
        for o in pre.step():
            text += o.text
    h = pre.export_handoff(rid)
    copy_blocks(pre, dec, pre.held_blocks(rid), dec.reserve(rid, h.num_computed))
    pre.release(rid)
    dec.admit(h)
    while dec.has_unfinished():
        for o in dec.step():
            text += o.text
    assert text == whole and text


def test_reserve_refuses_when_full_and_release_frees():
    eng = tiny_engine(0, num_blocks=8)
    ids = eng.reserve("a", 20)
    assert len(ids) == 5 and eng.blocks.num_free == 3
    from engine import ResourceExhaustedError

    with pytest.raises(ResourceExhaustedError):
        eng.reserve("b", 20)
    assert eng.abort("a")
    eng.blocks.check_all_free()


def test_decode_side_drafts_from_the_shipped_hidden_state():
    """Prefill ships no drafts, only the EAGLE-3 head's hidden state at the last prompt
    position; the decode side drafts from it (its first step already verifies drafts) and the
    greedy output still equals one engine's."""
    from tests.spec.test_eagle3 import random_head

    base = tiny_engine(0, max_num_batched_tokens=32)
    head = random_head(base)
    spec = SpecConfig(num_tokens=3, dynamic=False)
    colo = Engine(replace(base.config, spec=spec), weights_of=base, draft_head=head)
    pre = Engine(replace(base.config, spec=spec, handoff_drafts=False), weights_of=base,
                 draft_head=head)
    dec = Engine(replace(base.config, spec=spec), weights_of=base, draft_head=head)
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16)
    want = [c.token_ids for c in colo.generate(prompts, params)]
    shipped = []
    admit = dec.admit

    def spy(h):
        shipped.append(h)
        admit(h)
        shipped[-1] = (h, list(dec.seqs[h.request_id].draft))

    dec.admit = spy
    assert disaggregated(pre, dec, prompts, params) == want
    assert len(shipped) == len(prompts)
    for h, drafted in shipped:
        assert h.draft == [] and h.hidden is not None
        assert h.hidden.shape == (head.cfg.hidden_size,) and h.hidden.isfinite().all()
        assert len(drafted) == 3  # the decode side drafted K tokens from the hidden state
    # The same drafts the prefill side would have made and shipped itself.
    pre2 = Engine(replace(base.config, spec=spec), weights_of=base, draft_head=head)
    dec2 = Engine(replace(base.config, spec=spec), weights_of=base, draft_head=head)
    own = []
    admit2 = dec2.admit
    dec2.admit = lambda h: (own.append(list(h.draft)), admit2(h))
    assert disaggregated(pre2, dec2, prompts, params) == want
    assert own == [d for _, d in shipped]
