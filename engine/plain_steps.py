"""Overlapped plain greedy decoding: step N+1 is launched before the host reads step N.

A plain greedy step's only data-dependent input is the previous token, so the next step is
staged on the host and its token ids copied on the device from this step's argmax; emitting and
stop checks run while the GPU computes. It mirrors the fused speculative step's
`fused_launch` / `fused_continue` / `fused_finish`; sampled requests, prefill chunks and
hand-offs take the regular path. A speculative engine steps here while it warms
(`warming.py`): its decode graphs also return the head's layer inputs, which are left unread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.graphs import PackedInputs, TableRows, pack_next
from engine.runner import ModelRunner, pack_batch
from engine.sequence import Sequence
from engine.spec.fused import join_inputs
from engine.spec.verify import VerifyResult


@dataclass
class DecodeHandle:
    """A launched plain decode step: its sequences, every row's greedy token on the device
    (graph outputs: valid until that graph replays again) and the host copy being made."""

    seqs: list[Sequence]
    argmax: torch.Tensor
    fetch: object  # () -> list[int], waits for the copy

    def protect(self) -> None:
        """An own copy of the tokens the next step's continuation reads (see
        `FusedHandle.protect`)."""
        self.argmax = self.argmax.clone()

    @property
    def kcur(self) -> list[int]:
        """Drafts verified per sequence (none: the engine's batch view of this step)."""
        return [0] * len(self.seqs)


class PlainSteps:
    """Plain greedy decode steps through the runner's decode graphs, launched ahead."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner):
        self.cfg, self.runner = cfg, runner
        self.fused_runs = 0  # steps launched here (one replay, one read)
        self.overlapped_runs = 0  # of those, launched before the previous step was read
        self.compacted_runs = 0  # of those, leaving out requests that finished meanwhile
        self.joined_runs = 0  # of those, taking in sequences prefilled beside the last
        self._tables = TableRows()  # the continuations' block tables, row by row

    def fused_launch(self, batch, blocks, step: int, capture=None) -> DecodeHandle | None:
        """Launch the batch's decode step from the host's view; None when it must take the
        regular path (no graphs, a trainer's capture tap, an entry that is not a greedy
        decode)."""
        g = self.runner.graphs
        if g is None or capture is not None:
            return None
        if not all(s.greedy_decode(n) and n == 1 for s, n in zip(batch.seqs, batch.num_tokens)):
            return None
        inp = pack_batch(batch, self.cfg.block_size)
        if not g.supports(inp):
            return None
        return self._launch(batch.seqs, inp, None)

    def fused_continue(self, prev: DecodeHandle, blocks, step: int,
                       keep: list[int] | None = None, join=()) -> DecodeHandle | None:
        """Launch the step after `prev` before reading it: prev computes each sequence's pending
        token (position len - 1), this step the token prev emits (position len). Sequences that
        certainly finish at prev, or whose requests finished, are left out; None (drain instead)
        when none continues or the free blocks cannot hold one more token for each. `keep`: only
        these of prev's rows may continue. `join`: sequences prefilled beside prev take rows after
        prev's, at their pending token."""
        cfg = self.cfg
        rows = range(len(prev.seqs)) if keep is None else keep
        # A sequence whose token from prev reaches its length limit finishes at prev: it
        # leaves the continuation now, as one that finished while prev was in flight did.
        kept = [i for i in rows
                if len(prev.seqs[i]) + 1 < prev.seqs[i].length_limit(cfg.max_model_len)]
        if not kept:
            return None
        if len(kept) < len(prev.seqs):
            keep = kept
        old = [prev.seqs[i] for i in kept]
        seqs = old + list(join)
        # Room for every sequence's next token at once (`grow_all`), or drain.
        if not blocks.grow_all(seqs, [len(s) + 1 for s in old] + [len(s) for s in join]):
            return None
        # (len + 1 < length limit <= max_model_len: the table fits the graphs' columns.)
        b = len(old)
        tab = self._tables([s.block_table for s in seqs])
        self.overlapped_runs += 1
        self.compacted_runs += keep is not None
        self.joined_runs += bool(join)
        sel = None if keep is None else self.runner.stager.index(keep)
        inp = join_inputs(pack_next(old, tab[:b], cfg.block_size), join, 1, tab,
                          cfg.block_size)
        return self._launch(seqs, inp, prev, sel, b)

    def _launch(self, seqs, inp: PackedInputs, prev: DecodeHandle | None,
                sel: torch.Tensor | None = None, cont_rows: int | None = None) -> DecodeHandle:
        """Replay a decode graph for inp; after `prev`, the token ids of the first
        `cont_rows` rows (default all) are what prev chose (its rows `sel`, default all),
        copied on the device; the rest (joining) are the ones the host packed."""
        b = len(seqs)
        c = b if cont_rows is None else cont_rows
        prepare = None
        if prev is not None:
            def prepare(ids, pos, meta):  # this step's tokens: what prev chose, on the device
                ids[:c].copy_(prev.argmax if sel is None else prev.argmax[sel])
        out = self.runner.graphs.run(inp, prepare=prepare)
        self.fused_runs += 1
        top = out[1][:b]  # (hidden, greedy tokens, the aux layers' inputs if any)
        return DecodeHandle(list(seqs), top, self.runner.stager.fetch(top))

    @staticmethod
    def fused_finish(h: DecodeHandle):
        """Wait for a launched step; ({entry: (0, VerifyResult)}, {entry: no drafts})."""
        toks = h.fetch()
        return ({j: (0, VerifyResult([t], 0)) for j, t in enumerate(toks)},
                {j: [] for j in range(len(toks))})
