"""Prompt-lookup (n-gram) drafting: reuse what followed the latest earlier copy of the suffix."""

from __future__ import annotations

import numpy as np

from engine.spec.drafter import Drafter


class NgramDrafter(Drafter):
    """Prompt-lookup decoding, no weights: for n from max_n down to min_n, find the latest
    earlier occurrence of the last n tokens and propose the k tokens that followed it
    (`continue_copy`); longer matches win. Without `seq_id` a stateless numpy scan; with it an
    incremental `NgramIndex` per sequence, so a long sequence is not rescanned every step."""

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, token_ids: list[int], k: int, seq_id: str | None = None) -> list[int]:
        """k tokens that followed the latest earlier copy of the longest matching suffix (none
        without a match)."""
        if k <= 0:
            return []
        if seq_id is None:
            return ngram_search(token_ids, k, self.max_n, self.min_n)
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.max_n, self.min_n)
        index.sync(token_ids)
        return index.lookup(k)

    def release(self, seq_id: str) -> None:
        """Forget seq_id's index (call when the sequence finishes or is aborted)."""
        self._indexes.pop(seq_id, None)


def ngram_search(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Stateless prompt lookup over the whole sequence (see NgramDrafter)."""
    if k <= 0:
        return []
    n, end = ngram_match(token_ids, max_n, min_n)
    return continue_copy(token_ids, end, k) if n else []


def ngram_match(token_ids: list[int], max_n: int = 4, min_n: int = 2) -> tuple[int, int]:
    """(n, end): the longest suffix of min_n..max_n tokens with an earlier copy, and where
    the latest such copy ends (what follows it starts at `end`); (0, 0) without a match."""
    length = len(token_ids)
    if length < min_n + 1:
        return 0, 0
    arr = np.fromiter(token_ids, dtype=np.int64, count=length)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Candidate starts s = 0 .. L-1-n, so every candidate ends at e = s+n <= L-1: never the
        # suffix itself, and at least one continuation token always exists. One 1-D compare
        # per offset keeps this O(L * n) with no [L, n] temporaries.
        span = length - n
        hit = arr[:span] == arr[span]
        for j in range(1, n):
            hit &= arr[j : span + j] == arr[span + j]
        starts = np.flatnonzero(hit)
        if starts.size:
            return n, int(starts[-1]) + n
    return 0, 0


# Off: a copy ends where it reaches the present (the rule before loops were continued), for
# A/B runs (bench/loop_copies.py). The device lookup reads it at each launch, so a captured
# graph keeps the value it was captured with.
CONTINUE_LOOPS = True


def continue_copy(tokens, end: int, k: int) -> list[int]:
    """k tokens from tokens[end:], continued as the sequence itself would: where the copy
    reaches the last token, the last len(tokens) - end tokens repeat (the suffix matched at
    `end` is then a loop of that period), so answers that end in short loops keep accepting."""
    period = len(tokens) - end
    if k <= period or not CONTINUE_LOOPS:
        return list(tokens[end : end + k])
    return [tokens[end + i % period] for i in range(k)]


class NgramIndex:
    """Incremental n-gram -> latest end position map for one sequence. Indexes every n-gram
    but those forming the current suffix, so a lookup finds only earlier occurrences; rebuilt
    from scratch if the tokens seen before changed (a rollback)."""

    def __init__(self, max_n: int = 4, min_n: int = 2):
        self.max_n = max_n
        self.min_n = min_n
        self._tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        self._end = 0  # n-grams ending at positions <= _end are indexed

    def sync(self, token_ids: list[int]) -> None:
        """Bring the index up to date with token_ids (prompt + output so far)."""
        old = self._tokens
        if len(token_ids) < len(old) or token_ids[: len(old)] != old:
            self._tokens, self._latest, self._end = [], {}, 0
            old = self._tokens
        old.extend(token_ids[len(old) :])
        toks, latest = self._tokens, self._latest
        for e in range(self._end + 1, len(toks)):
            # Increasing e, so a later occurrence overwrites an earlier one: we keep the latest.
            for n in range(self.min_n, min(self.max_n, e) + 1):
                latest[tuple(toks[e - n : e])] = e
        self._end = max(self._end, len(toks) - 1)

    def lookup(self, k: int) -> list[int]:
        """k tokens after the latest earlier copy of the longest matching suffix, or none."""
        toks = self._tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            end = self._latest.get(tuple(toks[-n:]))
            if end is not None:
                return continue_copy(toks, end, k)
        return []
