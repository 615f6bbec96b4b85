"""A speculative engine that `generate` prepared decodes plainly while its speculative graphs
are not captured ("warming"), so its first call runs as fast as an engine without speculation.

Before its first step, `generate` captures only what plain decoding replays (the target's
decode graphs at one query and its prefill graphs, `begin`); the speculative graphs (verify
graphs of longer queries, the head's, the fused step's) wait in `Warming.pending`. While
warming, steps run through `PlainSteps`, propose no drafts and do no head work. After each
`generate`, with no sequence holding KV the head skipped, a share of the call's time
captures pending graphs (`plan`); once none is pending the engine speculates. A long call
does not wait for its end: once the plain work since warming began would have paid for every
pending graph at EXPECTED_GAIN, the next step captures them all and the engine speculates
from then on (`during`), the requests holding KV the head skipped finishing without drafts.
A serving process (`prepare_to_serve`) captures everything at start-up and never warms."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine import jit_watch
from engine.graphs import bucket_for

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger(__name__)
# Share of a generate's wall time spent after it capturing pending speculative graphs.
WARM_SHARE = 0.02
# Speculation's assumed speed-up over plain decoding: a call whose plain work is long enough
# that this gain would have paid for every pending graph captures them all.
EXPECTED_GAIN = 1.5
# Seconds per graph captured, until captures have been timed.
DEFAULT_SECONDS_PER_GRAPH = 0.05


def plan(wall: float, per_graph: float, pending: int, credit: float = 0.0) -> int:
    """How many of `pending` graphs to capture after a generate whose plain work took `wall`
    seconds, at `per_graph` seconds each: all of them where speculation, at EXPECTED_GAIN,
    would have saved more than their capture on that call; else those that fit WARM_SHARE of
    `wall` plus `credit` (capture time earned and not spent by earlier calls, or overspent)."""
    per_graph = max(per_graph, 1e-9)
    if pending * per_graph < wall * (1 - 1 / EXPECTED_GAIN):
        return pending
    return max(0, min(pending, int((credit + WARM_SHARE * wall) / per_graph)))


@dataclass
class Warming:
    """The speculative graphs an engine still lacks, and what their capture costs."""

    pending: list = field(default_factory=list)  # (graph set, key) of speculative graphs
    seconds: float = 0.0  # capture time measured so far
    graphs: int = 0  # graphs captured in that time
    credit: float = 0.0  # capture time earned by plain work and not spent (`plan`)
    sizes: set = field(default_factory=set)  # batch sizes stepped since the last capture
    call_started: float = 0.0  # when the current generate's plain work began
    worked: float = 0.0  # seconds of plain steps since warming began (`during`)

    @property
    def per_graph(self) -> float:
        """Seconds per graph captured (measured, or the default before any capture)."""
        return self.seconds / self.graphs if self.graphs else DEFAULT_SECONDS_PER_GRAPH

    def add(self, eng: Engine, keys) -> int:
        """Capture now the graphs plain decoding replays among `keys` ((graph set, key) pairs,
        `warmup.pending_graphs`); the others join `pending`. Returns how many were captured."""
        plain = [(g, k) for g, k in keys if _plain(eng, g, k)]
        seen = {(id(g), k) for g, k in self.pending}
        self.pending += [(g, k) for g, k in keys
                         if not _plain(eng, g, k) and (id(g), k) not in seen]
        return self.capture(eng, plain)

    def capture(self, eng: Engine, keys, budget: float | None = None) -> int:
        """Capture `keys` in order, as start-up work (its compiles stall no stream), stopping
        before a capture that would pass `budget` seconds (None: no limit); returns how many
        keys were gone through."""
        t0, n = time.perf_counter(), 0
        with eng.on_device(), torch.inference_mode(), jit_watch.starting_up():
            for g, key in keys:
                if budget is not None and time.perf_counter() - t0 + self.per_graph > budget:
                    break
                if key not in g.graphs:
                    t = time.perf_counter()
                    g.capture(*key)
                    self.seconds += time.perf_counter() - t
                    self.graphs += 1
                n += 1
        return n

    def ordered(self) -> list:
        """Pending keys not captured yet: those of buckets stepped since the last capture
        first, larger buckets first within each group."""
        ran: dict[int, set] = {}

        def rank(item):
            g, key = item
            if id(g) not in ran:
                ran[id(g)] = {bucket_for(s, g.buckets) for s in self.sizes}
            return key[0] not in ran[id(g)], -key[0]

        return sorted((x for x in self.pending if x[1] not in x[0].graphs), key=rank)


def wanted(eng: Engine, keys) -> bool:
    """Whether a generate preparing `eng` for `keys` warms: it speculates with the head's
    graphs, captures cost time (CUDA; elsewhere graphs run eagerly, registered for free), and
    no request stepped before holds KV or drafts (those keep the speculative path)."""
    return eng.spec is not None and eng.spec.graphs is not None and _clean(eng) and \
        any(getattr(g, "capturable", False) for g, _ in keys)


def begin(eng: Engine, keys) -> int:
    """Start warming `eng`, or add to its pending work (a larger generate; tests force warming
    with keys of their own): capture the graphs plain decoding needs among `keys` now, pend
    the rest; returns how many were captured. A fresh engine with nothing to pend does not
    warm."""
    fresh = eng.warming is None
    w = eng.warming or Warming()
    n = w.add(eng, keys)
    if fresh and w.pending:
        eng.warming, eng.runner.plain_only = w, True
    return n


def after_generate(eng: Engine) -> None:
    """End of `Engine.generate`: where no sequence holds KV computed while warming, capture
    the pending graphs `plan` allows, the buckets this call ran first; leave warming once
    none is pending."""
    w = eng.warming
    if w is None or not _clean(eng):
        return
    wall = time.perf_counter() - w.call_started
    keys = w.ordered()
    n = plan(wall, w.per_graph, len(keys), w.credit)
    budget = None if n == len(keys) else w.credit + WARM_SHARE * wall
    t0 = time.perf_counter()
    done = w.capture(eng, keys[:n], budget)
    if budget is not None:
        w.credit = budget - (time.perf_counter() - t0)
    w.pending, w.sizes = keys[done:], set()
    left = leave(eng)
    log.info("generate: %d speculative CUDA graphs captured in %.2f s after %.1f s of plain "
             "decoding; %s", done, time.perf_counter() - t0, wall,
             "speculation on from the next step" if left else f"{len(w.pending)} pending")


def during(eng: Engine) -> None:
    """Before a step of a warming engine: leave warming if nothing is pending and no request
    holds KV the head skipped; else, once the plain steps so far would have paid for every
    pending graph at EXPECTED_GAIN (`plan`), capture them all now and speculate from this
    step on, the requests holding KV the head skipped capped at no drafts (their drafts
    would read head KV never written) and the prefix cache forgotten (its blocks lack head
    KV as well)."""
    w = eng.warming
    if not w.pending:
        leave(eng)
        return
    if plan(w.worked, w.per_graph, len(w.pending), 0.0) < len(w.pending):
        return
    eng._carry += eng.overlap.drain()  # no step in flight while graphs are captured
    t0 = time.perf_counter()
    done = w.capture(eng, w.ordered())
    skipped = [s for s in eng.seqs.values() if s.block_table]
    for seq in skipped:
        seq.max_draft = 0
    log.info("%d speculative CUDA graphs captured in %.2f s after %.1f s of plain decoding: "
             "speculation on; %d running requests finish without drafts", done,
             time.perf_counter() - t0, w.worked, len(skipped))
    w.pending = []
    _speculate(eng)


def finish(eng: Engine) -> int:
    """`prepare_to_serve` on a warming engine: capture every pending graph, and leave warming
    where no sequence holds KV computed while warming; returns how many were captured."""
    w = eng.warming
    before = w.graphs
    w.pending = w.ordered()
    w.pending = w.pending[w.capture(eng, w.pending):]
    left = leave(eng)
    log.info("prepare_to_serve: %d speculative CUDA graphs captured; %s", w.graphs - before,
             "speculation on" if left else "warming until no request holds KV")
    return w.graphs - before


def leave(eng: Engine) -> bool:
    """Stop warming if no graph is pending and no sequence holds KV computed while warming;
    returns whether the engine speculates now."""
    w = eng.warming
    if w is None:
        return True
    if any(key not in g.graphs for g, key in w.pending) or not _clean(eng):
        return False
    _speculate(eng)
    return True


def _speculate(eng: Engine) -> None:
    """Leave warming: the fused step's continuation compiled, the prefix cache forgotten."""
    fused = eng.spec.fused
    if fused is not None:
        with eng.on_device(), jit_watch.starting_up():
            fused.warm_continuation()
    _forget_cached(eng)
    eng.warming, eng.runner.plain_only = None, False


def _plain(eng: Engine, g, key) -> bool:
    """Whether graph `key` of set `g` is one plain decoding replays: the target's decode
    graph at one query, or its prefill graph."""
    r = eng.runner
    return g is r.prefill_graphs or (g is r.graphs and key[1] == 1)


def _clean(eng: Engine) -> bool:
    """No step in flight, nothing held or reserved, and no request holds KV blocks: no
    sequence has positions the head did not step over."""
    return eng.overlap.inflight is None and not eng.held and not eng.reserved and \
        not any(s.block_table for s in eng.seqs.values())


def _forget_cached(eng: Engine) -> None:
    """Drop the prefix cache: blocks registered while warming have no head KV, so a request
    reusing them would draft from a context the head never saw. Blocks in use stay with their
    requests, unregistered (`forget_cached`)."""
    if eng.blocks.enable_prefix_caching:
        eng.blocks.forget_cached()
