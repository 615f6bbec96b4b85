"""engine/collector.py: objects alive at start-up leave the collector's walks; the
benchmarks give them back before discarding an engine."""

from __future__ import annotations

import gc
import weakref


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
