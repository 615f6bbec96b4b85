"""Block manager: refcounts, chained prefix hashes, reuse order."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, block_hash
from engine.sequence import SamplingParams, Sequence


def seq(tokens):
    return Sequence(tokens, SamplingParams())


def computed(bm, s):
    bm.grow(s, len(s))
    s.num_computed = len(s)
    bm.commit(s)


def test_hash_is_chained_and_stable():
    a = block_hash(b"", [1, 2, 3, 4])
    assert a == block_hash(b"", [1, 2, 3, 4])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(b"", [5, 6, 7, 8])


def test_prefix_match_shares_blocks_and_skips_last_token_block():
    bm = BlockManager(16, 4)
    s1 = seq(list(range(12)))
    computed(bm, s1)
    s2 = seq(list(range(12)))
    assert bm.match_prefix(s2) == 8  # 3 full blocks, but the last token's block is recomputed
    assert s2.block_table == s1.block_table[:2]
    assert [bm.ref[b] for b in s1.block_table] == [2, 2, 1]
    s3 = seq(list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.match_prefix(s3) == 8
    s4 = seq([0, 1, 2, 99] + list(range(4, 12)))
    assert bm.match_prefix(s4) == 0  # chained: a different first block changes every hash


def test_release_keeps_hash_until_reused():
    bm = BlockManager(4, 4)
    s1 = seq(list(range(9)))
    computed(bm, s1)
    bm.release(s1)
    assert bm.num_free == 4
    s2 = seq(list(range(9)))
    assert bm.match_prefix(s2) == 8  # blocks came back from the free list
    bm.release(s2)
    filler = seq(list(range(100, 116)))
    bm.grow(filler, 16)  # takes every block, evicting the cached ones
    bm.release(filler)
    assert bm.match_prefix(seq(list(range(9)))) == 0


def test_lru_reuse_order_keeps_prefix_longest():
    bm = BlockManager(8, 4)
    s1 = seq(list(range(16)))
    computed(bm, s1)
    bm.release(s1)
    fresh = seq(list(range(100, 104)))
    bm.grow(fresh, 4)
    # The free blocks never held s1 come first; then s1's tail before its head.
    assert fresh.block_table[0] not in s1.block_table


def test_double_release_is_caught():
    bm = BlockManager(4, 4)
    s = seq([1, 2, 3])
    bm.grow(s, 3)
    table = list(s.block_table)
    bm.release(s)
    s.block_table = table
    with pytest.raises(AssertionError):
        bm.release(s)


def test_check_all_free_reports_held_blocks():
    bm = BlockManager(4, 4)
    s = seq([1, 2, 3, 4, 5])
    bm.grow(s, 5)
    with pytest.raises(AssertionError, match="still held"):
        bm.check_all_free()


def test_table_rows_track_growing_tables_like_a_fresh_array():
    """The continuations' block-table array, kept between steps (`graphs.TableRows`), equals
    a fresh `table_array` after every change a running batch sees: tables growing (a few rows
    a step), a row's sequence replaced (a new list: released, handed over), rows dropping out
    and the batch growing past the array's size; padding past each row is zero."""
    import random

    import numpy as np

    from engine.graphs import TableRows, table_array

    rng = random.Random(3)
    rows, most = TableRows(), 0
    tables = [[rng.randrange(1000) for _ in range(rng.randrange(1, 4))] for _ in range(5)]
    for step in range(60):
        for t in rng.sample(tables, k=2):
            t.append(rng.randrange(1000))  # grows in place, as BlockManager.grow does
        if step % 7 == 3:
            tables[rng.randrange(len(tables))] = [rng.randrange(1000)]  # a new list
        if step % 11 == 5:
            tables.pop(rng.randrange(len(tables)))  # finished: the rows after move up
        if step % 13 == 0:
            tables.append([rng.randrange(1000) for _ in range(rng.randrange(1, 9))])
        got = rows(tables)
        assert np.array_equal(got, table_array(tables)), step
        most = max(most, len(tables))
    assert most > 5  # the batch outgrew the first array
