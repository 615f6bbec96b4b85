"""Overlapped decoding: the next greedy decode step is launched from the device outputs of the
step in flight, so emitting, detokenizing and stop checks run while the GPU computes.

Requests finishing mid-flight drop out of the next launch (their rows are discarded, blocks
freed once read). Arrivals that fit whole are prefilled beside the step in flight and join the
next launch; any other change to the running set drains the pipeline first."""

from __future__ import annotations

from operator import is_not
from typing import TYPE_CHECKING

from engine.output import RequestOutput
from engine.scheduler import Batch
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.engine import Engine


class Overlap:
    """The step in flight, and which requests may join the one launched after it."""

    def __init__(self, eng: Engine):
        self.eng = eng
        self.inflight = None  # (Batch, handle): a step launched and not read yet
        self.deferred: list[Sequence] = []  # finished meanwhile: blocks freed once it is read

    def start(self, h) -> None:
        """Hold the launched step `h` in flight."""
        self.inflight = (Batch(list(h.seqs), [1 + k for k in h.kcur]), h)

    def step(self):
        """Read the step in flight while the next is launched from its outputs; returns
        (the batch read, its results, the outputs)."""
        e = self.eng
        batch, h = self.inflight
        # Requests prefilled beside h join it (`joining`), and requests due to be admitted
        # are prefilled beside it (`admit_beside`); anything else drains the pipeline.
        keep = _unfinished(batch)
        live = batch.select(keep)
        join = self.joining(live) if keep else None
        nxt = pre = None
        if join is not None:
            due = self.admission_due()
            # The prefill goes on the stream before the continuation, so reading it waits
            # for h and itself, not for the step launched next.
            pre = self.admit_beside(h) if due else None
            if pre is not None or not due:
                nxt = e.pipe.fused_continue(h, e.blocks, e.stats.steps + 2,
                                            keep if len(keep) < len(batch.seqs) else None,
                                            join.seqs)
            if pre is not None and nxt is not None:
                nxt.protect()  # the head's step after the prefill replays graphs of its pool
        if nxt is None:
            outs = self.drain()
            results = {}
        else:
            results, drafts = self.read(h, keep)
            self.start(nxt)
            outs = e.post.process(live, None, results, drafts)
        if pre is not None:  # its step mixed in a prefill: not one the cost model prices
            outs += self.read_beside(*pre)
            results = {}
        return live, results, outs + self.settle()

    def can_overlap(self, batch: Batch) -> bool:
        """The next step may be launched before this one is read: overlap is on, no request
        waits to be admitted, and the running set is exactly this batch."""
        if self.admission_due():
            return False
        join = self.joining(batch)
        return join is not None and not join.seqs

    def admission_due(self) -> bool:
        """Whether waiting requests stop the overlap now, to be admitted after the drain: when there
        is room for them and enough wait, or the oldest has waited `admission_delay_steps` steps
        (`EngineConfig.admission_share`), so several arrivals share one drain."""
        e = self.eng
        sch, cfg = e.scheduler, e.config
        if not sch.waiting or len(sch.running) >= cfg.max_num_seqs:
            return False
        if cfg.admission_delay_steps <= 0 or \
                len(sch.waiting) >= max(1, len(sch.running) // cfg.admission_share):
            return True
        oldest = min(s.arrival_step for s in sch.waiting)
        return e.stats.steps - oldest >= cfg.admission_delay_steps

    def settle(self) -> list[RequestOutput]:
        """After reading a step while the next is in flight: drain if the running set
        changed other than by requests finishing or being prefilled to join it, or if
        requests are due to be admitted that cannot be prefilled beside it."""
        if self.inflight is None:
            return []
        live = self.inflight[0].select(_unfinished(self.inflight[0]))
        if not live.seqs or self.joining(live) is None or \
                (self.admission_due() and not self.admits_beside()):
            return self.drain()
        return []

    def joining(self, live: Batch) -> Batch | None:
        """The running requests besides `live` (the unfinished entries of the step in
        flight), as the entries they join its continuation with: requests prefilled beside
        it, each one greedy pending token plus its drafts. None when the running set differs
        from `live` in any other way (then the pipeline drains)."""
        e = self.eng
        if not e.config.overlap or e.capture is not None:
            return None
        run, n = e.scheduler.running, len(live.seqs)
        if len(run) < n or any(map(is_not, run, live.seqs)):
            return None
        join = Batch()
        for s in run[n:]:
            if not s.greedy_decode(1 + len(s.draft)):
                return None
            join.add(s, 1 + len(s.draft))
        return join

    def beside_ok(self, seq: Sequence) -> bool:
        """Whether a waiting request may be prefilled beside a decode step in flight: a
        greedy request that decodes here (sampled ones and hand-offs take the drain)."""
        return seq.params.greedy and not seq.hold and \
            seq.num_pending <= self.eng.config.max_num_batched_tokens

    def admits_beside(self) -> bool:
        """Whether the next waiting request can be prefilled beside the step in flight."""
        e = self.eng
        sch = e.scheduler
        return e.config.admit_in_flight and bool(sch.waiting) and \
            self.beside_ok(sch.waiting[0]) and e.stepper.splits()

    def admit_beside(self, h):
        """Admit the waiting requests that can be prefilled whole beside the step in flight
        `h` (`beside_ok`, their KV blocks free) and launch their prefill without waiting for
        it: (batch, forward, read) for `read_beside`, or None (drain and admit instead)."""
        if not self.admits_beside():
            return None
        e = self.eng
        r = e.scheduler.admit_whole(e.config.max_num_batched_tokens, self.beside_ok)
        if not r.seqs:
            return None
        # Graphs share memory pools: the prefill's scratch may be where h's outputs live,
        # which the continuation after it reads.
        h.protect()
        e.admitted_in_flight += len(r.seqs)
        return (r, *e.runner.run(r, e.aux_layers, e.generators, defer=True))

    def read_beside(self, batch: Batch, fwd, read) -> list[RequestOutput]:
        """Read and postprocess a prefill launched beside a step in flight: the first token and,
        with speculation, the head's step over the prompt, but no drafts. The requests join the
        next continuation (`joining`), which drafts for them with everyone else, since drafting
        here would stall the pipeline for a step at every arrival."""
        return self.eng.post.process(batch, fwd, read(), count_step=False, draft=False)

    def drain(self) -> list[RequestOutput]:
        """Read the step in flight, free the blocks of requests that finished meanwhile (it
        may have written into them), and postprocess the requests still running."""
        if self.inflight is None:
            return []
        batch, h = self.inflight
        self.inflight = None
        keep = _unfinished(batch)
        results, drafts = self.read(h, keep)
        if not keep:
            return []
        return self.eng.post.process(batch.select(keep), None, results, drafts)

    def read(self, h, keep: list[int]) -> tuple[dict, dict]:
        """Wait for the launched step h; free the blocks of requests that finished while it
        was in flight (it was the last step to write into them); return its results and
        drafts for the entries `keep`, renumbered in that order."""
        e = self.eng
        results, drafts = e.pipe.fused_finish(h)
        for seq in self.deferred:
            e.blocks.release(seq)
        self.deferred = []
        if len(keep) == len(h.seqs) == len(results) == len(drafts):  # every entry, in order
            return results, drafts
        return ({j: results[i] for j, i in enumerate(keep)},
                {j: drafts[i] for j, i in enumerate(keep)})


def _unfinished(batch: Batch) -> list[int]:
    """Indices of the batch's entries whose requests are still running."""
    return [i for i, s in enumerate(batch.seqs) if not s.finished]
