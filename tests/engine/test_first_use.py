"""`Engine.generate` on an engine nothing prepared captures, before its first step, the graphs
of the buckets its batches use (a speculative engine: those plain decoding replays), and a
later larger call the larger ones (`warmup.prepare_on_first_use`). Off CUDA there are no
graphs: the capture is stood in for here; tests/engine/test_gpu_engine.py checks the real
one."""

from __future__ import annotations

import time

import pytest

import engine.warmup as warmup
from engine import Engine, SamplingParams, warming
from engine.testing import tiny_engine

SP = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
ALL = range(1, 65)


@pytest.fixture
def graphs(monkeypatch):
    """Buckets (as batch sizes) captured so far, and each capture call's largest size; the
    capture runs only outside steps."""
    state = {"captured": set(), "calls": [], "stepping": False}

    def pending(eng, sizes=None, long_context=None):
        return sorted(set(ALL if sizes is None else sizes) - state["captured"])

    def capture(eng, sizes=None, progress=False, long_context=None):
        assert not state["stepping"], "a capture inside a step stalls the batch"
        new = set(ALL if sizes is None else sizes) - state["captured"]
        state["captured"] |= new
        state["calls"].append(max(ALL if sizes is None else sizes))
        return len(new)

    real_step = Engine.step

    def step(eng):
        state["stepping"] = True
        try:
            return real_step(eng)
        finally:
            state["stepping"] = False

    monkeypatch.setattr(warmup, "pending_graphs", pending)
    monkeypatch.setattr(Engine, "capture_graphs", capture)
    monkeypatch.setattr(Engine, "step", step)
    return state


def test_each_call_captures_the_buckets_it_needs_before_stepping(graphs):
    eng = tiny_engine(0)
    eng.generate([[1, 2, 3]], SP)
    assert graphs["calls"] == [1] and graphs["captured"] == {1}
    assert eng.prepared_for == 1 and eng.ready is not None
    eng.generate([[1, 2, 3]] * 5, SP)  # larger: its buckets, before its first step
    assert graphs["calls"] == [1, 5] and graphs["captured"] == set(range(1, 6))
    assert eng.prepared_for == 5
    eng.generate([[4, 5]] * 2, SP)  # smaller: nothing to capture
    assert graphs["calls"] == [1, 5]


def test_batches_are_capped_at_max_num_seqs(graphs):
    eng = tiny_engine(0, max_num_seqs=4)
    eng.generate([[1, 2, 3]] * 9, SP)
    assert graphs["calls"] == [4] and eng.prepared_for == 4


def test_prepare_to_serve_after_generate_captures_the_rest(graphs):
    eng = tiny_engine(0)
    eng.generate([[1, 2, 3]] * 2, SP)
    eng.prepare_to_serve()
    assert graphs["captured"] == set(ALL) and eng.prepared_for is None
    eng.generate([[1, 2, 3]] * 8, SP)  # prepared to serve: nothing more, ever
    assert graphs["calls"] == [2, 64]


def test_an_engine_prepared_to_serve_captures_nothing_in_generate(graphs):
    eng = tiny_engine(0)
    eng.prepare_to_serve(batch_sizes=(1, 2))
    assert eng.prepared_for is None
    eng.generate([[1, 2, 3]] * 6, SP)  # a caller that chose its batch sizes keeps them
    assert graphs["calls"] == [2]


class Capturable:
    """A graph set whose captures cost time as on CUDA (`capturable`), recorded here."""

    capturable = True
    buckets = (1, 2, 4)

    def __init__(self):
        self.graphs: dict = {}

    def capture(self, b: int, q: int, long: bool = False) -> None:
        self.graphs[(b, q, long)] = None


def _speculative_engine() -> Engine:
    """A tiny engine speculating with a random EAGLE-3 head at a fixed K of 2."""
    from dataclasses import replace

    from engine.config import SpecConfig
    from engine.testing import random_head

    base = tiny_engine(0)
    return Engine(replace(base.config, spec=SpecConfig(num_tokens=2, dynamic=False)),
                  weights_of=base, draft_head=random_head(base))


def test_a_speculative_engine_captures_only_what_plain_decoding_replays(monkeypatch):
    """With the head's graphs enabled, the first call captures the target's decode graphs at
    one query (and its prefill graphs) only; verify graphs of longer queries and the head's
    wait while the engine warms (tests/engine/test_spec_warming.py)."""
    from engine.spec.runtime import SpecRunner

    eng = _speculative_engine()
    target, head = Capturable(), Capturable()
    keys = [(target, (4, q, False)) for q in (3, 2, 1)] + [(head, (4, 1, False))]
    monkeypatch.setattr(warmup, "pending_graphs", lambda e, sizes=None, long_context=None:
                        [(g, k) for g, k in keys if k not in g.graphs])
    monkeypatch.setattr(SpecRunner, "graphs", head)  # the head's graphs enabled
    rid = eng.add_request([1, 2, 3], SP)
    eng.step()  # a request stepped before holds KV (and drafts): no warming beside it
    assert not warming.wanted(eng, keys)
    eng.abort(rid)
    assert warming.wanted(eng, keys)
    monkeypatch.setattr(eng.runner, "graphs", target)
    warmup.prepare_on_first_use(eng, 3)
    assert set(target.graphs) == {(4, 1, False)} and not head.graphs
    assert eng.ready is not None and eng.prepared_for == 3 and eng.pipe is eng.plain
    assert [(g, k) for g, k in eng.warming.pending] == keys[:2] + keys[3:]


def test_the_ready_time_counts_making_the_pending_graph_sets(monkeypatch):
    """A warming engine's `ready` covers `pending_graphs` too (where EAGLE-3's graph sets are
    made), so what a first call serves after it is only serving."""
    from engine.spec.runtime import SpecRunner

    eng = _speculative_engine()
    target, head = Capturable(), Capturable()
    keys = [(target, (4, 1, False)), (head, (4, 1, False))]

    def slow_pending(e, sizes=None, long_context=None):
        time.sleep(0.2)
        return [(g, k) for g, k in keys if k not in g.graphs]

    monkeypatch.setattr(warmup, "pending_graphs", slow_pending)
    monkeypatch.setattr(SpecRunner, "graphs", head)
    monkeypatch.setattr(eng.runner, "graphs", target)
    warmup.prepare_on_first_use(eng, 3)
    assert eng.warming is not None and eng.ready.total >= 0.2


def test_a_graph_sets_stager_pins_its_slots_when_used():
    """A graph set's stager holds no host buffers until the set is captured or run (a warming
    engine's pending sets pin nothing); a slot comes zeroed, and a larger request than the
    slots hold drops them all for larger ones. Other stagers pin every slot at once."""
    from engine.staging import HostStager

    assert all(h is not None for h in HostStager("cpu", 8, slots=3).host)
    s = HostStager("cpu", 8, slots=3, ahead=False)
    assert s.host == [None] * 3
    buf, i = s.slot(5)
    assert i == 0 and buf.shape == (8,) and not buf.any() and s.host[1:] == [None] * 2
    buf[:] = 7
    s.slot(8)
    buf, i = s.slot(20)
    assert i == 2 and buf.shape == (20,) and not buf.any() and s.size == 20
    assert s.host[0] is None and s.host[1] is None
    s.pin()
    assert all(h is not None and h.shape == (20,) for h in s.host)
    from engine.graphs import GraphSet

    g = GraphSet(lambda *a: (), "cpu", max_batch=2, query_lens=(1,), max_blocks=2)
    assert g.stager.host == [None] * len(g.stager.host)
    g.capture(1, 1)
    assert all(h is not None for h in g.stager.host)
