"""More arrivals than a captured prefill chunk holds replay the chunk graphs group by group
(`GraphSet.run_split`) instead of running the model eagerly: the same rows out, the same
tokens, and no split where padding would outweigh the work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import triton_available
from engine.graphs import GraphSet, pack

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")


def _set(max_batch: int = 4) -> tuple[GraphSet, list]:
    seen = []

    def fn(ids, pos, meta, extra):
        seen.append(ids.shape[0])
        return ids * 2, pos + 1, extra[:, 0] * 3

    return GraphSet(fn, "cpu", max_batch, (8, 16, 32), 16, extras=((1, torch.int64),),
                    pad_queries=True), seen


def _inputs(qlens, block_size: int = 4):
    ids, pos, tables, base = [], [], [], 0
    for i, q in enumerate(qlens):
        ids += [100 * i + j for j in range(q)]
        pos += list(range(3, 3 + q))
        tables.append([base + b for b in range(-(-(3 + q) // block_size))])
        base += len(tables[-1])
    return pack(ids, pos, tables, qlens, block_size)


def test_take_is_the_sequences_alone():
    inp = _inputs([5, 2, 7, 1])
    sub = inp.take(1, 3)
    assert sub.ids.tolist() == inp.ids[5:14].tolist()
    assert sub.starts.tolist() == [0, 2, 9]
    assert sub.lens.tolist() == inp.lens[1:3].tolist()
    assert sub.tables.tolist() == inp.tables[1:3].tolist()
    assert sub.max_query_len == 7 and sub.num_seqs == 2


def test_split_rows_equal_one_run():
    gs, seen = _set()
    inp = _inputs([5, 2, 7, 1, 6, 3])  # six sequences, four a chunk
    extra = torch.arange(inp.num_tokens, dtype=torch.int64)[:, None] + 10
    assert not gs.supports(inp) and gs.supports_split(inp)
    ids, pos, ex = gs.run_split(inp, (extra,))
    assert ids.tolist() == (inp.ids * 2).tolist()
    assert pos.tolist() == (inp.pos + 1).tolist()
    assert ex.tolist() == ((np.arange(inp.num_tokens) + 10) * 3).tolist()
    # Two groups: four sequences padded to 8 rows each, then two (the bucket of 2) to 8.
    assert seen == [32, 16]
    assert {(4, 8, False), (2, 8, False)} <= set(gs.graphs)


def test_no_split_where_padding_outweighs_the_rows():
    gs, _ = _set()
    # Eleven one-token rows beside a 30-token prompt: every group pads to 32 queries.
    inp = _inputs([1] * 11 + [30])
    assert not gs.supports_split(inp)
    assert not gs.supports_split(_inputs([40, 1, 1, 1, 1]))  # a query past the longest
    assert gs.supports_split(_inputs([20, 18, 25, 30, 22]))


def test_many_arrivals_prefill_through_the_chunk_graphs():
    """Six prompts prefilled in one chunk (more than PREFILL_BATCH sequences) on the
    static-bucket path, run eagerly on the CPU: the torch backend's greedy tokens, and the
    prefill graphs replayed for the groups instead of an eager forward."""
    from engine.runner import PREFILL_BATCH
    from engine.sequence import SamplingParams
    from tests.helpers import tiny_engine

    ref = tiny_engine(num_blocks=128, max_num_batched_tokens=256, attention_backend="torch")
    tri = ref.with_config(attention_backend="triton")
    tri.runner.enable_graphs(8, (1,), ())
    prompts = [[1 + i, 2, 3, 4 + i, 5, 6, 7 + i][: 3 + i] for i in range(6)]
    assert len(prompts) > PREFILL_BATCH
    runs, run = [], tri.runner.prefill_graphs.run
    tri.runner.prefill_graphs.run = lambda inp, *a, **kw: runs.append(inp.num_seqs) or \
        run(inp, *a, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    a = [c.token_ids for c in ref.generate(prompts, params)]
    b = [c.token_ids for c in tri.generate(prompts, params)]
    assert a == b
    assert runs[:2] == [4, 2]  # the six arrivals: one group of four, one of two
    tri.blocks.check_all_free()


def test_many_arrivals_with_eagle3_head():
    """The same with an EAGLE-3 head: its first step over the six prompts replays its own
    chunk graphs group by group, and the output is plain greedy decoding's."""
    from engine.sequence import SamplingParams
    from tests.helpers import tiny_engine
    from tests.spec.test_eagle3 import fast_engine, random_head

    base = tiny_engine(0, max_num_batched_tokens=256)
    eng = fast_engine(base, random_head(base), num_tokens=3, dynamic=False)
    prompts = [[(5 * i + j) % 40 + 1 for j in range(4 + 2 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ref = [c.token_ids for c in base.generate(prompts, params)]
    runs, run = [], eng.spec.prefill_graphs.run
    eng.spec.prefill_graphs.run = lambda inp, *a, **kw: runs.append(inp.num_seqs) or \
        run(inp, *a, **kw)
    assert [c.token_ids for c in eng.generate(prompts, params)] == ref
    assert runs[:2] == [4, 2]
    eng.blocks.check_all_free()


def test_graphs_captured_ahead_are_those_a_buckets_batches_may_run():
    """`GraphSet(wants=)`: `pending` lists only the (bucket, query length) graphs that
    wants(q, lo, hi) admits for the bucket's batch sizes lo..hi (the fused step's dense
    levels from a batch size: `fused.level_wanted`); without it, every one."""
    from engine.graphs import GraphSet

    calls = []

    def wants(q, lo, hi):
        calls.append((q, lo, hi))
        return q != 6 or hi >= 8

    def fn(ids, pos, meta):
        return (ids,)

    g = GraphSet(fn, "cpu", 16, (1, 6, 8), 4, buckets=(1, 2, 4, 8, 12), wants=wants)
    keys = g.pending()
    assert {(b, q) for b, q, _ in keys} == {(b, q) for b in (1, 2, 4, 8, 12, 16)
                                            for q in (1, 6, 8) if q != 6 or b >= 8}
    assert {(lo, hi) for _, lo, hi in calls} == {(1, 1), (2, 2), (3, 4), (5, 8), (9, 12),
                                                 (13, 16)}
    every = GraphSet(fn, "cpu", 16, (1, 6, 8), 4, buckets=(1, 2, 4, 8, 12))
    assert len(every.pending()) == 6 * 3
