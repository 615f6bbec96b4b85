"""Prompt-lookup drafter: both the stateless scan and the incremental index."""

from __future__ import annotations

import random
import time

import pytest

from engine.spec.ngram import NgramDrafter, NgramIndex, ngram_search


def reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule, spelled out naively: latest earlier copy of the longest matching suffix,
    and what followed it; a copy that reaches the present goes on as the sequence would if
    the drafts so far were right (token by token: draft i is what sits at end + i once the
    drafts before it are appended)."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[-n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                grown = list(tokens)
                for i in range(k):
                    grown.append(grown[end + i])
                return grown[length:]
    return []


# Both ways of calling the drafter must obey every rule below.
@pytest.fixture(params=["scan", "index"])
def propose(request):
    drafter = NgramDrafter(max_n=4, min_n=2)
    seq_id = None if request.param == "scan" else "seq"
    return lambda tokens, k: drafter.propose(tokens, k, seq_id)


def test_most_recent_match(propose):
    # Suffix [1, 2] occurs twice earlier; the later copy was followed by 7, 8.
    tokens = [1, 2, 5, 6, 9, 1, 2, 7, 8, 3, 1, 2]
    assert propose(tokens, 2) == [7, 8]


def test_prefers_longer_ngram(propose):
    # 2-gram [2, 3] last occurs before 9, but the 3-gram [1, 2, 3] only before 5, 6.
    tokens = [1, 2, 3, 5, 6, 0, 2, 3, 9, 9, 1, 2, 3]
    assert propose(tokens, 2) == [5, 6]


def test_no_match(propose):
    assert propose([1, 2, 3, 4, 5, 6], 3) == []
    assert propose([1, 2], 3) == []  # too short for any earlier copy
    assert propose([], 3) == []


def test_min_n_respected(propose):
    # Only a 1-gram repeats ([4]); min_n=2 must not use it.
    assert propose([4, 1, 2, 3, 4], 2) == []


def test_respects_k(propose):
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose(tokens, 3) == [3, 4, 5]
    assert propose(tokens, 1) == [3]
    assert propose(tokens, 0) == []


def test_copy_reaching_the_present_continues_as_a_loop(propose):
    # The latest copy of [7, 7] overlaps the suffix: one token follows it, then the loop
    # it is part of (period 1) goes on.
    assert propose([3, 7, 7, 7], 5) == [7, 7, 7, 7, 7]
    # [1, 2] was followed by 9, 1, 2: the period-3 loop 9, 1, 2 repeats.
    assert propose([1, 2, 9, 1, 2], 5) == [9, 1, 2, 9, 1]
    assert propose([1, 2, 9, 1, 2], 2) == [9, 1]


@pytest.mark.parametrize("max_n,min_n", [(4, 2), (3, 1), (2, 2)])
def test_matches_reference_on_random_growth(max_n, min_n):
    """Both paths equal the naive rule at every step of a growing, repetitive sequence."""
    rng = random.Random(max_n * 10 + min_n)
    drafter = NgramDrafter(max_n=max_n, min_n=min_n)
    tokens: list[int] = []
    for _ in range(400):
        tokens.append(rng.randrange(6))
        k = rng.randrange(1, 6)
        want = reference(tokens, k, max_n, min_n)
        assert ngram_search(tokens, k, max_n, min_n) == want
        assert drafter.propose(tokens, k, "s") == want


def test_index_rebuilds_after_rollback():
    rng = random.Random(7)
    tokens = [rng.randrange(4) for _ in range(60)]
    index = NgramIndex(4, 2)
    index.sync(tokens)
    # Drop a tail, then diverge from it: stale n-grams must not survive.
    tokens = tokens[:40] + [rng.randrange(4) for _ in range(10)]
    index.sync(tokens)
    assert index.lookup(5) == reference(tokens, 5, 4, 2)
    tokens[10] = 99  # an edit in the middle
    index.sync(tokens)
    assert index.lookup(5) == reference(tokens, 5, 4, 2)


def test_release_forgets_sequence():
    drafter = NgramDrafter()
    assert drafter.propose([1, 2, 3, 1, 2], 2, "a") == [3, 1]
    drafter.release("a")
    assert "a" not in drafter._indexes
    drafter.release("a")  # idempotent


def test_bad_params():
    with pytest.raises(ValueError):
        NgramDrafter(max_n=2, min_n=3)
    with pytest.raises(ValueError):
        NgramDrafter(min_n=0)


def test_fast_on_8k_tokens():
    """Called every decode step: an 8k-token sequence must stay well under a millisecond-ish.

    Bounds are loose (shared CI cores) but catch an accidental O(L^2) or per-token Python scan.
    """
    rng = random.Random(0)
    tokens = [rng.randrange(32000) for _ in range(8192)]
    drafter = NgramDrafter()
    start = time.perf_counter()
    for _ in range(50):
        ngram_search(tokens, 5)
    scan = (time.perf_counter() - start) / 50
    drafter.propose(tokens, 5, "s")  # builds the index once
    start = time.perf_counter()
    for _ in range(200):
        tokens.append(rng.randrange(32000))
        drafter.propose(tokens, 5, "s")
    step = (time.perf_counter() - start) / 200
    assert scan < 5e-3, scan
    assert step < 1e-3, step
