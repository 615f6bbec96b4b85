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
