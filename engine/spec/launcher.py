"""The fused speculative step from the host's side: pack a greedy batch, choose the next
drafts' K ahead of the step, replay the fused graph (`FusedSteps`), launch the step after it
from its device outputs, and read a finished step back."""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import torch

from engine.config import EngineConfig
from engine.graphs import PackedInputs, TableRows, pack_next
from engine.spec.budget import DraftBudget
from engine.spec.fused import (
    FusedHandle,
    FusedOut,
    FusedSteps,
    continuation,
    join_inputs,
    pack_uniform,
)
from engine.spec.policy import KPolicy
from engine.spec.verify import VerifyResult
from engine.staging import HostStager

_TABLE = attrgetter("block_table")


def _widest(seqs) -> int:
    """The longest block table of `seqs`."""
    return max(map(len, map(_TABLE, seqs)))


class FusedLauncher:
    """Launches and reads fused steps; `fused` is None until the head's graphs exist."""

    def __init__(self, cfg: EngineConfig, policy: KPolicy, budget: DraftBudget,
                 stager: HostStager):
        self.cfg, self.policy, self.budget, self.stager = cfg, policy, budget, stager
        self.fused: FusedSteps | None = None
        self.fused_runs = 0  # steps that ran as one fused graph
        self.overlapped_runs = 0  # of those, launched from the previous step's device outputs
        self.known_continuations = 0  # of those, at K=0 with positions known on the host
        self.compacted_runs = 0  # of those, leaving out requests that finished meanwhile
        self.joined_runs = 0  # of those, taking in sequences prefilled beside the last
        self._tables = TableRows()  # the continuations' block tables, row by row

    def launch(self, batch, blocks, step: int, capture=None) -> FusedHandle | None:
        """Launch a fused step from the host's view of the batch; read it with `finish`.
        None when the batch must take the step-by-step path."""
        f = self.fused
        if f is None or capture is not None:
            return None
        seqs = batch.seqs
        if not all(s.greedy_decode(n) for s, n in zip(seqs, batch.num_tokens)):
            return None
        if len(seqs) > f.max_batch or _widest(seqs) > f.max_blocks:
            return None
        kcur = [len(s.draft) for s in seqs]
        # Next drafts are chosen before this step's acceptance is known (a one-step lag): the
        # pending token after this step is at most token len + k + 1.
        self.policy.begin_propose(step, len(seqs))
        want = self.policy.choose_batch(seqs, len(seqs))
        kn = self.budget.ks_for(seqs, [len(s) + k + 1 for s, k in zip(seqs, kcur)], blocks,
                                want)
        q = next(x for x in f.levels_at(len(seqs))[0] if x > max(kcur))
        inp = pack_uniform(seqs, q, self.cfg.block_size)
        h = self._run(seqs, kcur, [k or 0 for k in kn], q, inp, None)
        h.continuable = None not in kn  # the next step's pending tokens have their blocks
        return h

    def launch_after(self, prev: FusedHandle, blocks, step: int,
                     keep: list[int] | None = None, join=()) -> FusedHandle | None:
        """Launch the step after `prev` before reading it: pending tokens, drafts, positions and KV
        slots come from prev's outputs on the device, so host work on prev overlaps this step. K for
        the step after is chosen now, capped as if everything is accepted. `keep`: only these of
        prev's rows continue. `join`: sequences prefilled beside prev take rows after prev's."""
        f = self.fused
        # (The per-row picks and table widths below map in C: they run for every sequence of
        # every overlapped step.)
        rows = range(len(prev.seqs)) if keep is None else keep
        old = list(map(prev.seqs.__getitem__, rows))
        seqs = old + list(join)
        if not prev.continuable or _widest(seqs) > f.max_blocks:
            return None
        kprev = list(map(prev.kcur.__getitem__, rows))
        kcur = list(map(prev.kn.__getitem__, rows)) + [len(s.draft) for s in join]
        self.policy.begin_propose(step, len(seqs))
        want = self.policy.choose_batch(seqs, len(seqs))
        # This step's tokens were given blocks when prev chose its drafts (or, joining, when
        # the drafts were proposed); the pending token after it and the drafts it makes get
        # theirs now (none free: drain instead).
        needs = [len(s) + kp + kc + 2 for s, kp, kc in zip(old, kprev, kcur)] + \
            [len(s) + len(s.draft) + 1 for s in join]
        kn = self.budget.ks_for(seqs, needs, blocks, want)
        if None in kn or _widest(seqs) > f.max_blocks:
            return None
        q = next(x for x in f.levels_at(len(seqs))[0] if x > max(kcur))
        b, bs = len(old), self.cfg.block_size
        tab = self._tables(list(map(_TABLE, seqs)))
        sel = None if keep is None else self.stager.index(keep)
        self.overlapped_runs += 1
        self.compacted_runs += keep is not None
        self.joined_runs += bool(join)
        if q == 1 and prev.q == 1:
            # Nothing verified by prev and nothing to verify now (a batch at K=0): prev
            # emits exactly one token, so every position is known here, as in a plain
            # decode; only the token ids come from prev's outputs.
            self.known_continuations += 1
            inp = join_inputs(pack_next(old, tab[:b], bs), join, q, tab, bs)
            return self._run(seqs, kcur, kn, q, inp, prev, known=True, sel=sel, cont_rows=b)
        # Host part: block tables and query starts; the rest is a placeholder the device
        # overwrites. Context upper bound: every draft of prev accepted.
        bound = np.fromiter((len(s) + kp + q for s, kp in zip(old, kprev)), np.int64, b)
        inp = PackedInputs(np.zeros(b * q, np.int64), np.zeros(b * q, np.int64),
                           np.full(b * q, -1, np.int64), np.arange(b + 1, dtype=np.int64) * q,
                           bound, tab[:b], q)
        return self._run(seqs, kcur, kn, q, join_inputs(inp, join, q, tab, bs), prev,
                         sel=sel, cont_rows=b)

    def _run(self, seqs, kcur, kn, q, inp, prev: FusedHandle | None,
             known: bool = False, sel: torch.Tensor | None = None,
             cont_rows: int | None = None) -> FusedHandle:
        """Replay the fused step for inp; after `prev`, the device inputs of its first `cont_rows`
        rows (default all) come from prev's rows `sel` (default all): all of them (`continuation`),
        or only token ids (`known`). Rows after those (joining sequences) keep what the host
        packed."""
        b = len(seqs)
        c = b if cont_rows is None else cont_rows
        cont, drafting = not known and prev is not None, any(kn)
        prepare = None
        if known:
            def prepare(ids, pos, meta):
                prev_ids = prev.out.argmax[: len(prev.seqs)]
                ids[:c].copy_(prev_ids if sel is None else prev_ids[sel])
        # One copy to the device for the continuation's state (num_computed per continued
        # sequence, then its draft count this step) and the draft count per row, which a
        # step drafting nothing never reads.
        parts = []
        if cont:
            parts += [np.fromiter((s.num_computed for s in seqs[:c]), np.int64, c),
                      np.asarray(kcur[:c], dtype=np.int64)]
        if drafting:
            rows = np.zeros(b * q, dtype=np.int64)
            rows[::q] = kn
            parts.append(rows)
        dev = self.stager.to_device(np.concatenate(parts)) if parts else None
        if cont:
            prepare = continuation(prev, dev[: 2 * c], c, q, self.cfg.block_size, sel)
        extras = (dev[-b * q:][:, None],) if drafting else ()
        out = FusedOut(*self.fused.set_for(max(kn), len(seqs)).run(inp, extras, prepare))
        self.fused_runs += 1
        # Outputs live in the graph pool, which the next replay overwrites: the host reads a
        # copy, and a continuation reads this step's outputs before its own replay. A step
        # that verified and drafted nothing (K=0) accepted nothing: only its tokens are read.
        if q == 1 and out.drafts is None:
            flat = out.argmax
        else:
            flat = torch.cat([out.argmax, out.accepted[:b]] +
                             ([out.drafts[:b].reshape(-1)] if out.drafts is not None else []))
        return FusedHandle(seqs, kcur, kn, q, out, flat, self.stager.fetch(flat))

    @staticmethod
    def finish(h: FusedHandle):
        """Wait for a launched fused step; ({entry: (k, VerifyResult)}, {entry: drafts})."""
        flat = h.fetch()
        b, q, kcur, kn = len(h.seqs), h.q, h.kcur, h.kn
        grid = flat[: b * q]
        head = b * q + b  # where the drafts start
        if len(flat) == b * q:  # a K=0 step: its tokens only (`_run`)
            nacc, width = [0] * b, 0
        else:
            nacc, width = flat[b * q : head], (len(flat) - head) // b
        results, drafts = {}, {}
        for j in range(b):
            n = nacc[j]
            results[j] = (kcur[j], VerifyResult(grid[j * q : j * q + n + 1], n))
            d0 = head + j * width
            drafts[j] = flat[d0 : d0 + kn[j]]
        return results, drafts
