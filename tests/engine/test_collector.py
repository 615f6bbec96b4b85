"""engine/collector.py: objects alive at start-up leave the collector's walks; the
benchmarks give them back before discarding an engine; captures pause the collector; every
collection's pause is timed."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_frozen_objects_are_skipped_until_unfrozen():
    from bench.common import free_memory
    from engine.collector import freeze_long_lived

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
    gone = weakref.ref(a)
    try:
        assert freeze_long_lived() > 0 and gc.get_freeze_count() > 0
        assert not any(o is a for o in gc.get_objects())  # no longer walked
        del a, b
        gc.collect()
        assert gone() is not None  # frozen: the cycle outlives a full collection
    finally:
        free_memory()  # unfreezes, then collects
    assert gc.get_freeze_count() == 0 and gone() is None


def test_prepare_to_serve_captures_freezes_and_watches_compiles(monkeypatch):
    """`Engine.prepare_to_serve`, what nodes and `tandem serve` run before the first request:
    every graph captured, the objects alive then frozen, compiles logged from then on."""
    from engine import jit_watch
    from engine.collector import unfreeze
    from tests.helpers import tiny_engine

    eng = tiny_engine(0)
    captured = []

    def capture(batch_sizes=None, progress=False, long_context=None):
        captured.append(progress)
        return 3

    monkeypatch.setattr(eng, "capture_graphs", capture)
    monkeypatch.setattr(jit_watch, "_warn_from", None)
    try:
        assert eng.prepare_to_serve(progress=True) == 3 and captured == [True]
        assert gc.get_freeze_count() > 0 and jit_watch._warn_from is not None
    finally:
        unfreeze()


def test_paused_runs_no_automatic_collection_and_restores_the_state():
    from engine.collector import paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused():
        assert not gc.isenabled()
        raise RuntimeError("inside")
    assert gc.isenabled()  # back on, the exception notwithstanding
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # a collector off before stays off
    finally:
        gc.enable()
    outer, inner = paused(), paused()  # two threads' captures overlapping, not nested
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert not gc.isenabled()  # the second is still inside
    inner.__exit__(None, None, None)
    assert gc.isenabled()


@pytest.mark.gpu
def test_a_discarded_engines_graphs_are_not_freed_mid_capture(monkeypatch):
    """Destroying a CUDA graph while a stream captures invalidates that capture, and an
    automatic collection may free a discarded engine's graphs at any allocation: the last
    reference to an old engine goes inside a capture, with collections due at every few
    allocations; the capture holds, and the old engine is freed afterwards."""
    from engine import Engine, EngineConfig
    from engine.testing import smol_shape

    cfg = EngineConfig(model=smol_shape(num_layers=2), dtype=torch.float32, device="cuda",
                       num_blocks=256, attention_backend="triton")
    old = Engine(cfg)
    assert old.capture_graphs([1, 2]) > 0
    cycle = {"engine": old}
    cycle["self"] = cycle  # once unreachable, only the cyclic collector frees the old engine
    box, gone = [cycle], weakref.ref(old)
    del old, cycle
    new = Engine(cfg)
    begin = torch.cuda.CUDAGraph.capture_begin

    def begin_then_drop(self, *args, **kw):
        begin(self, *args, **kw)
        box.clear()  # the old engine is cyclic garbage from here on
        _ = [[] for _ in range(1000)]  # allocations that make a collection due

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_then_drop)
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        assert new.capture_graphs([1, 2, 4]) > 0
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert gone() is None
    assert all(g is not None for g, _ in new.runner.graphs.graphs.values())


def test_every_collection_is_counted_and_timed():
    """`watch_pauses`: each collection, automatic or called, adds one pause and its seconds
    (what `tandem_gc_pauses_total` and the figures' windows report)."""
    from engine.collector import pauses, watch_pauses

    watch_pauses()
    watch_pauses()  # once per process: a second call adds no second callback
    n0, s0 = pauses()
    gc.collect()
    gc.collect(0)
    n1, s1 = pauses()
    assert n1 - n0 == 2 and s1 > s0


def test_frozen_cycles_are_freed_at_exit():
    """A serving process exits with its start-up objects frozen: the interpreter's last
    collection still finalizes the cycles among them (a frozen Triton object would otherwise
    be reported as leaked by its bindings at every `tandem serve` exit)."""
    code = (
        "from engine.collector import freeze_long_lived\n"
        "class Node:\n"
        "    def __del__(self):\n"
        "        print('finalized', flush=True)\n"
        "a, b = Node(), Node()\n"
        "a.other, b.other = b, a\n"
        "assert freeze_long_lived() > 0\n"
        "del a, b\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("finalized") == 2
