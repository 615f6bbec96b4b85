"""Continuous batching with chunked prefill under a per-step token budget."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, Status


@dataclass
class Batch:
    """What one forward computes: `num_tokens[i]` new tokens of `seqs[i]`."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    out_of_blocks: list[Sequence] = field(default_factory=list)  # finished: cache is full

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def select(self, indices) -> Batch:
        """The entries at `indices`, in that order (no out-of-blocks list)."""
        # (map: the per-entry loop runs in C, twice a step for every running sequence)
        return Batch(list(map(self.seqs.__getitem__, indices)),
                     list(map(self.num_tokens.__getitem__, indices)))

    def __len__(self) -> int:
        return len(self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs or self.out_of_blocks)


class Scheduler:
    """Running requests first (decodes and unfinished prefill chunks), then new arrivals.

    When blocks run out, the most recent running request is preempted: its blocks are
    released and it recomputes later (its full blocks usually come back from the prefix cache).
    """

    def __init__(self, cfg: EngineConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in its blocks (a hand-off) joins the running batch."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch, budget = Batch(), self.cfg.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.num_pending, budget)
            if seq.draft:
                if n == seq.num_pending and n + len(seq.draft) <= budget and \
                        self.blocks.can_grow(seq, seq.num_computed + n + len(seq.draft)):
                    n += len(seq.draft)
                else:
                    seq.draft, seq.draft_q = [], None  # no room to verify: plain decode
            if self._make_room(seq, seq.num_computed + n):
                batch.add(seq, n)
                budget -= n
            elif seq.finished:
                batch.out_of_blocks.append(seq)
        self._admit(batch, budget)
        return batch

    def admit_whole(self, budget: int, ok) -> Batch:
        """Admit waiting requests from the front of the queue whose whole remaining prompt
        fits `budget` tokens and the free blocks, while `ok(seq)` holds: one prefill entry
        each, the rest of the batch left running as it is (the engine prefills them beside a
        decode step in flight). Stops at the first request that does not qualify."""
        batch = Batch()
        self._admit(batch, budget, ok)
        return batch

    def _admit(self, batch: Batch, budget: int, whole=None) -> None:
        """Move waiting requests from the front of the queue to the running set, each with
        its next prefill chunk, while the token budget, max_num_seqs and the free blocks
        allow. `whole`: only whole remaining prompts, and only while whole(seq) holds."""
        while self.waiting and budget and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if whole is not None and not whole(seq):
                break
            self.blocks.match_prefix(seq)
            n = seq.num_pending if whole is not None else min(seq.num_pending, budget)
            if n > budget or not self.blocks.can_grow(seq, seq.num_computed + n):
                self.blocks.release(seq)
                break
            self.blocks.grow(seq, seq.num_computed + n)
            self.blocks.count_lookup(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq` to `num_tokens`, preempting later requests if needed; False if seq itself
        had to go."""
        while not self.blocks.can_grow(seq, num_tokens):
            if self.running == [seq]:
                # Alone and still no room: the whole cache cannot hold it. Stop, don't thrash.
                self.finish(seq, "length")
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.draft, seq.draft_q = [], None
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> None:
        """Mark finished and free its blocks at once (unless kept for a hand-off)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if not keep_blocks:
            self.blocks.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
