"""Drafting from the context on the device (engine/spec/lookup.py): the token store and the
lookup give what `ngram_search` gives over the same tokens, in torch and in Triton."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from engine.spec import ngram
from engine.spec.lookup import lookup, store_tokens, token_store
from engine.spec.ngram import ngram_search


def _scatter(seqs, block_size: int, num_blocks: int, rng: random.Random):
    """Each sequence's tokens (all but the last, its bonus) at its blocks' slots, the blocks
    shuffled across the store; (store, tables, known, bonus)."""
    width = max(-(-len(s) // block_size) for s in seqs) + 1
    free = list(range(num_blocks))
    rng.shuffle(free)
    store = token_store(num_blocks * block_size, "cpu")
    tables = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        n = -(-len(s) // block_size)
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        pos = torch.arange(len(s) - 1)
        slots = tables[i, pos // block_size] * block_size + pos % block_size
        ids = torch.tensor(s[:-1] + [7] * 3)  # rows past the sequence store nowhere
        store_tokens(store, ids, torch.cat([slots, torch.full((3,), -1)]))
    known = torch.tensor([len(s) - 1 for s in seqs])
    bonus = torch.tensor([s[-1] for s in seqs])
    return store, tables, known, bonus


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: Triton's interpreter on CPU


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("min_n,loops", [(1, True), (2, True), (3, True), (2, False)])
def test_lookup_equals_ngram_search(kernel, min_n, loops, monkeypatch, k=5, max_n=4):
    """Copies continued as loops (the default) and cut at the present (`CONTINUE_LOOPS`
    off, for A/B runs) alike."""
    monkeypatch.setattr(ngram, "CONTINUE_LOOPS", loops)
    rng = random.Random(min_n)
    seqs = []
    for _ in range(24):
        vocab = rng.choice([3, 5, 20, 200])  # small vocabularies repeat, large ones rarely
        seqs.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 90))])
    seqs.append([1, 2, 3, 4, 1, 2, 3])  # the copy's continuation runs into the suffix
    seqs.append([9, 9])
    store, tables, known, bonus = (t.to(DEV) for t in _scatter(seqs, 4, 800, rng))
    live = torch.ones(len(seqs), dtype=torch.bool, device=DEV)
    live[3] = False
    lens, toks = lookup(store, tables, 4, known, bonus, live, k, max_n, min_n, kernel=kernel)
    lens, toks = lens.cpu(), toks.cpu()
    hits = cut = 0
    for i, s in enumerate(seqs):
        want = ngram_search(s, k, max_n, min_n) if live[i] else []
        got = toks[i, : lens[i]].tolist()
        assert got == want, (i, s)
        assert toks[i, lens[i]:].eq(0).all()
        hits += bool(want)
        cut += 0 < len(want) < k
    assert 5 < hits < len(seqs)  # both outcomes occur
    assert bool(cut) != loops  # continued copies fill all k drafts; cut ones may not


@pytest.mark.parametrize("kernel", [False, True])
def test_store_tokens_skips_rows_without_a_slot(kernel):
    store = token_store(8, DEV)
    store_tokens(store, torch.tensor([5, 6, 7], device=DEV), torch.tensor([3, -1, 0], device=DEV),
                 kernel=kernel)
    assert store[:8].tolist() == [7, 0, 0, 5, 0, 0, 0, 0]


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the static-bucket path run "
                              "eagerly on the CPU; on GPUs tests/engine/test_gpu_engine.py")


@CPU_ONLY
def test_context_drafts_fused_equal_step_by_step_and_stay_lossless(k=3):
    """An EAGLE-3 engine with `context_drafts`: the fused step (drafts looked up on the
    device) and the step-by-step path (on the host) keep the same drafts step for step, the
    lookup's drafts get accepted where the head's (random) are not, and the output equals
    plain decoding to the end."""
    from tests.spec.test_eagle3 import fast_engine, looping_setup, spec_engine

    base, head, prompts, sp, ref = looping_setup(2, 3, 32)
    # Each prompt ends with the first tokens plain decoding adds to it, so the target runs
    # into its own loops at once and the lookup's drafts get accepted within a few steps.
    prompts = [p + r[:8] for p, r in zip(prompts, ref)]
    sp = replace(sp, max_tokens=20)
    ref = [c.token_ids for c in base.generate(prompts, sp)]
    # The step-by-step path on the reference backend; the fused step alone and overlapped.
    step = spec_engine(base, head, num_tokens=k, dynamic=False, context_drafts=True)
    fused = fast_engine(base, head, num_tokens=k, dynamic=False, overlap=False,
                        context_drafts=True)
    overlap = fast_engine(base, head, num_tokens=k, dynamic=False, context_drafts=True)
    assert fused.token_store is not None and fused.spec.fused is not None
    engines = (step, fused, overlap)
    ids = [[e.add_request(p, sp) for e in engines] for p in prompts]
    seqs = [[e.seqs[r] for e, r in zip(engines, rids)] for rids in ids]
    for _ in range(6):
        for e in engines:
            e.step()
        for x, *others in seqs:
            for y in others:
                assert (x.token_ids, x.num_computed, x.draft) == (y.token_ids, y.num_computed,
                                                                   y.draft)
    assert fused.spec.fused_runs >= 4 and overlap.spec.overlapped_runs > 0
    for e in engines:
        while e.has_unfinished():
            e.step()
        assert [s.output_ids for s in (row[engines.index(e)] for row in seqs)] == ref
        e.blocks.check_all_free()
    head_only = spec_engine(base, head, num_tokens=k, dynamic=False, context_drafts=False)
    head_only.generate(prompts, sp)
    accepted = sum(step.spec.stats.accepted_per_pos)
    assert sum(overlap.spec.stats.accepted_per_pos) == accepted
    assert accepted > 2 * sum(head_only.spec.stats.accepted_per_pos) + 10
