"""Paged KV block accounting: refcounts, lazily grown block tables, chained-hash prefix caching."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Stable across processes, so a router can compute the same prefix keys."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockManager:
    """Owns which KV blocks are free, who holds them, and which full blocks can be reused.

    A freed block keeps its hash and stays reusable until it is handed out again; free blocks
    are reused least-recently-freed first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.by_hash: dict[bytes, int] = {}
        # Prompt tokens of admitted requests looked up in the prefix cache, and those found
        # (`count_lookup`); the metrics read them at scrape time.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that `num_tokens` tokens fit in its table."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks until `num_tokens` tokens fit; caller checked `can_grow`."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_fresh())

    def grow_all(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """Grow every seqs[i] to hold num_tokens[i] tokens if all fit together, else none:
        sequences of equal length cross a block boundary in the same step, and each alone
        fitting does not make all fit."""
        need = [self.blocks_needed(s, n) for s, n in zip(seqs, num_tokens)]
        if sum(need) > self.num_free:
            return False
        for s, n, k in zip(seqs, num_tokens, need):
            if k:
                self.grow(s, n)
        return True

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix; returns the tokens it covers.

        The last token is always recomputed (its logits are needed), so a block holding it
        is never taken from the cache.
        """
        assert not seq.block_table and seq.num_computed == 0
        if not self.enable_prefix_caching:
            return 0
        bs, parent, hit = self.block_size, b"", 0
        for i in range((len(seq) - 1) // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens)
            bid = self.by_hash.get(h)
            if bid is None or self.tokens_of[bid] != tuple(tokens):
                break
            if self.ref[bid] == 0:
                del self.free[bid]
            self.ref[bid] += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            parent, hit = h, hit + bs
        seq.num_computed = hit
        # usage reports prompt tokens: a continuation's or a preempted request's own output
        # may be cached too
        seq.num_cached_tokens = min(hit, seq.num_prompt_tokens)
        return hit

    def count_lookup(self, seq: Sequence) -> None:
        """Count the lookup (`match_prefix`) of a request that was admitted: once per
        admission, however many steps it waited for room at the head of the queue."""
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += len(seq)
            self.prefix_hit_tokens += seq.num_computed  # (just matched: every token found)

    def commit(self, seq: Sequence) -> None:
        """Register hashes of blocks that became full and computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            bid = seq.block_table[i]
            if h not in self.by_hash and self.hash_of[bid] is None:
                self.by_hash[h] = bid
                self.hash_of[bid] = h
                self.tokens_of[bid] = tuple(tokens)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks (finish, abort or preemption)."""
        # Tail first, so a request's prefix outlives its tail in the reuse order.
        for bid in reversed(seq.block_table):
            self.ref[bid] -= 1
            assert self.ref[bid] >= 0, f"block {bid} released twice"
            if self.ref[bid] == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def _take_fresh(self) -> int:
        bid, _ = self.free.popitem(last=False)
        h = self.hash_of[bid]
        if h is not None:
            if self.by_hash.get(h) == bid:
                del self.by_hash[h]
            self.hash_of[bid] = self.tokens_of[bid] = None
        self.ref[bid] = 1
        return bid

    def forget_cached(self) -> None:
        """Drop every cached prefix: free blocks stay free, blocks in use stay with their
        requests, and no later request finds either."""
        self.by_hash.clear()
        self.hash_of = [None] * self.num_blocks
        self.tokens_of = [None] * self.num_blocks

    def check_all_free(self) -> None:
        """Raise if any block is still held: the leak check tests and shutdown use."""
        held = [b for b, r in enumerate(self.ref) if r]
        if held or self.num_free != self.num_blocks:
            raise AssertionError(f"KV blocks still held: {held[:16]} ({len(held)} total)")
