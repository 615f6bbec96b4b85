"""One engine step: schedule → run → postprocess.

Greedy decodes run as one-graph steps (`SpecRunner.fused_launch` with EAGLE-3, `PlainSteps`
without speculation or while it warms, `warming.py`), the next launched before this one is
read where the batch allows (`overlap.py`); everything else runs through the regular forward
(`ModelRunner.run`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine import warming
from engine.cost_feed import time_step
from engine.graphs import GraphSet
from engine.output import RequestOutput
from engine.scheduler import Batch

if TYPE_CHECKING:
    from engine.engine import Engine


class Stepper:
    """Runs the engine's steps: a fresh one from the scheduler's batch, or the continuation of
    the step in flight (`Overlap.step`)."""

    def __init__(self, eng: Engine):
        self.eng = eng

    def step(self) -> list[RequestOutput]:
        """One step; returns what each touched request produced."""
        e = self.eng
        if e.warming is not None:
            warming.during(e)  # speculate once the graphs are captured, or worth capturing
        t0, captures = e.clock(), GraphSet.captures
        with e.on_device():  # kernels, graphs, streams go to this engine's GPU
            if e.overlap.inflight is not None:
                how = "overlapped"
                batch, results, outs = e.overlap.step()
            else:
                how = "fresh"
                batch = e.scheduler.schedule()
                outs = [e.post.finished_output(s) for s in batch.out_of_blocks]
                if not batch.seqs:
                    return outs
                batch, results, more = self.fresh(batch)
                outs += more
        # A graph captured inside would skew the cost model, and plain steps while warming
        # are no speculative steps it prices.
        if e.warming is not None:
            e.warming.sizes.add(len(batch.seqs))
            e.warming.worked += e.clock() - t0
        elif e.spec is not None and GraphSet.captures == captures:
            time_step(e.spec, batch, results, e.clock() - t0, how)
        return outs

    def fresh(self, batch: Batch):
        """A step of the scheduler's batch: a one-graph step where every entry is a greedy
        decode (the next launched behind it where nothing else waits), else the decodes
        apart from the rest (`split`), else the regular forward. Returns (the batch, its
        results, the outputs)."""
        e = self.eng
        if self.splits():
            dec = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                   if s.greedy_decode(n)]
            if dec and len(dec) < len(batch.seqs):
                return self.split(batch, dec)
        pipe = e.pipe
        h = None if pipe is None else \
            pipe.fused_launch(batch, e.blocks, e.stats.steps + 1, e.capture)
        if h is None:
            fwd, results = e.runner.run(batch, e.aux_layers, e.generators)
            return batch, results, e.post.process(batch, fwd, results)
        nxt = pipe.fused_continue(h, e.blocks, e.stats.steps + 2) \
            if e.overlap.can_overlap(batch) else None
        results, drafts = pipe.fused_finish(h)
        if nxt is not None:
            e.overlap.start(nxt)
        outs = e.post.process(batch, None, results, drafts)
        return batch, results, outs + e.overlap.settle()

    def splits(self) -> bool:
        """Whether a batch mixing greedy decodes with other entries runs the decodes apart
        (`split`): with speculation's fused step, or plain decode graphs (no speculation, or
        while it warms)."""
        e = self.eng
        if e.capture is not None:
            return False
        if e.spec is not None and e.warming is None:
            return e.spec.fused is not None
        return e.runner.graphs is not None

    def split(self, batch: Batch, dec: list[int]):
        """Greedy decodes beside entries the fused step cannot run (prefill chunks, sampled
        requests): the decodes still run as one graph and the rest through the regular forward in
        the same engine step, so arrivals do not push every decode onto the eager path."""
        e = self.eng
        pick = set(dec)
        d = batch.select(dec)
        r = batch.select([i for i in range(len(batch)) if i not in pick])
        h = e.pipe.fused_launch(d, e.blocks, e.stats.steps + 1)
        # Queued behind the fused graph: its sync covers both.
        fwd, results = e.runner.run(r, e.aux_layers, e.generators)
        outs = e.post.process(r, fwd, results)
        if h is not None:
            res_d, drafts = e.pipe.fused_finish(h)
            outs += e.post.process(d, None, res_d, drafts, count_step=False)
        else:  # no graph for the decodes' shape: the regular forward
            fwd, res_d = e.runner.run(d, e.aux_layers, e.generators)
            outs += e.post.process(d, fwd, res_d, count_step=False)
        return batch, {}, outs
